/** The client (PROTOCOL §3, §5.3 and §6.3). */

import { X509Certificate, createPrivateKey } from "node:crypto";
import { readFileSync } from "node:fs";
import { createSecureContext } from "node:tls";

import { nextOwner } from "./owner";
import { Places, checkPlaces } from "./places";
import * as plan from "./plan";
import * as proto from "./proto";
import { type Address, Pool, type TlsDial, parseAddress, sleepUntil } from "./pool";
import { Call, type CallOutcome, type Session } from "./session";
import { type KeepAliveOptions, type ReleaseOutcome, Ticket, type TicketHost } from "./ticket";

/** How an acquire ended. Only `"acquired"` lets the caller in. */
export type AcquireOutcome = "acquired" | "timeout" | "busy" | "limit_mismatch" | "indeterminate";
/** How an extend by token ended. */
export type ExtendTokenOutcome = "extended" | "not_held" | "indeterminate";

/** Connections a client keeps by default. */
export const DEFAULT_POOL_SIZE = 2;
/** Largest pool accepted. */
export const MAX_POOL_SIZE = 64;

/** Settings of a {@link Client}. */
export interface ClientOptions {
  /** Connections, 1..=64 (default 2). */
  poolSize?: number;
  /** Seconds one connection attempt (with its TLS handshake) may take (default 1). */
  connectTimeout?: number;
  /** The server's `--max-key-bytes` (default 1024). */
  maxKeyBytes?: number;
  /** TLS to every TCP address: a PEM file (path) of the CA certificates to trust. */
  tlsCa?: string;
  /** A client certificate (PEM path) for servers started with `--tls-client-ca`. */
  tlsCert?: string;
  /** The client certificate's private key (PEM path). */
  tlsKey?: string;
  /** Check every server's certificate against this name instead of each address's host. */
  tlsServerName?: string;
}

/** Options of one acquire. */
export interface AcquireOptions {
  /** Seconds to wait in the key's queue (fractions allowed, clamped to 255; default 10). */
  wait?: number;
  /** Seconds the grant lives, whole, 1..=255 (default 30). */
  lease?: number;
  /**
   * Ends the call early, as if its deadline came now: unsent, the outcome
   * is `"timeout"`; possibly sent, `"indeterminate"`, and a grant that
   * comes later is given back at once.
   */
  signal?: AbortSignal;
}

/** What {@link Client.acquire} returns. */
export interface AcquireResult {
  outcome: AcquireOutcome;
  /** The ticket when the outcome is `"acquired"`, else `null`. */
  ticket: Ticket | null;
  /**
   * The limit the key is registered with, when the outcome is
   * `"limit_mismatch"` (an acquire with places only, protocol 1.2).
   */
  limit?: number;
}

/** Thrown by {@link Client.lock} and {@link Client.withLock} when the lock was not acquired. */
export class NotAcquired extends Error {
  constructor(
    readonly key: string,
    /** `"timeout"`, `"busy"` or `"indeterminate"`: never enter in any case. */
    readonly outcome: Exclude<AcquireOutcome, "acquired">,
  ) {
    super(`lock ${JSON.stringify(key)} not acquired: ${outcome}`);
    this.name = "NotAcquired";
  }
}

/**
 * A handle on a small pool of connections to a ticketd server, or to the
 * nodes of a cluster, shared by every caller: requests are pipelined and
 * replies matched by owner, and by token and key, in any order.
 *
 * `address` is `"host:port"`, `"[v6]:port"`, `"unix:/path"`, or a list of
 * them (connections rotate over them and skip the ones that do not answer).
 * Connections open lazily, on the first call that needs one. A bad setting
 * throws `RangeError` / `TypeError` here; host names resolve when connecting.
 */
export class Client implements TicketHost {
  private readonly pool: Pool;
  private readonly maxKeyBytes: number;
  private backgroundReleases = 0;

  constructor(address: string | readonly string[], options: ClientOptions = {}) {
    const texts = typeof address === "string" ? [address] : [...address];
    if (texts.length === 0) {
      throw new RangeError("no server address was given");
    }
    const addrs: Address[] = texts.map(parseAddress);
    const poolSize = intSetting("poolSize", options.poolSize ?? DEFAULT_POOL_SIZE, 1, MAX_POOL_SIZE);
    const maxKeyBytes = intSetting(
      "maxKeyBytes",
      options.maxKeyBytes ?? plan.DEFAULT_MAX_KEY_BYTES,
      1,
      plan.MAX_KEY_BYTES_CEILING,
    );
    const connectTimeout = options.connectTimeout ?? 1;
    if (typeof connectTimeout !== "number" || !(connectTimeout > 0) || !Number.isFinite(connectTimeout)) {
      throw new RangeError("connectTimeout must be a number of seconds above zero");
    }
    this.maxKeyBytes = maxKeyBytes;
    this.pool = new Pool(addrs, poolSize, connectTimeout * 1000, maxKeyBytes, tlsDial(options), {
      orphanGrant: (key, token) => this.releaseInBackground(Buffer.from(key, "utf8"), key, token),
    });
  }

  /** The addresses, as given. */
  get addresses(): string[] {
    return this.pool.addrs.map((a) => a.text);
  }

  /**
   * The last connection failure, if any: explains a `"timeout"` that came
   * from an unreachable server rather than from a held key.
   */
  get lastConnectError(): string | null {
    return this.pool.lastError;
  }

  /** Connections open now, for diagnostics. */
  connectedSessions(): number {
    return this.pool.live().length;
  }

  /** Releases running in the background (late grants, dropped tickets). */
  pendingBackgroundReleases(): number {
    return this.backgroundReleases;
  }

  /**
   * Asks for `key`, queueing up to `wait` seconds for a grant that lives
   * `lease` seconds. Resolves within `wait` + 1 s (5 s for `wait: 0`), or
   * as soon as `signal` aborts. Throws only for bad arguments, before
   * anything is sent.
   */
  async acquire(key: string, options: AcquireOptions = {}): Promise<AcquireResult> {
    return this.acquireWith(key, null, options);
  }

  /**
   * One permit of `key` as a counting semaphore of `limit` places (protocol
   * 1.2, PROTOCOL §6): at most `limit` holders at once, each with a ticket
   * of its own. `"limit_mismatch"` (with `result.limit`) when the key is
   * registered with another limit. As {@link Client.acquire} otherwise; a
   * limit of 0 throws `RangeError`.
   */
  async acquirePermit(key: string, limit: number, options: AcquireOptions = {}): Promise<AcquireResult> {
    return this.acquireWith(key, Places.semaphore(limit), options);
  }

  /**
   * A reader's place in the read/write lock `key` (protocol 1.2): held
   * beside other readers, never beside a writer, and not before a writer
   * that queued first. As {@link Client.acquire} otherwise.
   */
  async acquireShared(key: string, options: AcquireOptions = {}): Promise<AcquireResult> {
    return this.acquireWith(key, Places.shared(), options);
  }

  /**
   * A writer's hold of the read/write lock `key` (protocol 1.2): alone,
   * after every reader and writer that queued first. As
   * {@link Client.acquire} otherwise.
   */
  async acquireExclusive(key: string, options: AcquireOptions = {}): Promise<AcquireResult> {
    return this.acquireWith(key, Places.exclusive(), options);
  }

  /**
   * The general acquire: with `places`, one of `places.limit` places in
   * `places.mode`, sent as an Acquire With Limit (protocol 1.2); with
   * `null`, a mutex ({@link Client.acquire}). A server older than 1.2 closes
   * the connection on an Acquire With Limit, so the outcome there is
   * `"indeterminate"`. Throws only for bad arguments (a limit of 0 among
   * them), before anything is sent.
   */
  async acquireWith(key: string, places: Places | null, options: AcquireOptions = {}): Promise<AcquireResult> {
    const raw = plan.checkKey(key, this.maxKeyBytes);
    const leaseS = plan.checkLease(options.lease ?? 30);
    const waitS = plan.normaliseWait(options.wait ?? 10);
    const wire = places === null ? null : checkPlaces(places);
    this.checkOpen();
    const signal = options.signal;
    const p = plan.acquirePlan(plan.now(), waitS);
    const owner = nextOwner();
    const pause = new RetryPause(p.sendDeadline, signal);
    for (;;) {
      // Retried only from here, and only while definitely unsent: same
      // owner, same plan, another session.
      const session = await this.pool.get(p.sendDeadline, signal);
      if (session === null) {
        return { outcome: "timeout", ticket: null };
      }
      const call = new Call("acquire", raw, key, p, owner, 0n, leaseS, wire);
      const outcome = await runWithSignal(session, call, signal);
      if (outcome === "not_sent") {
        await pause.pause();
        continue;
      }
      if (outcome === "lost") {
        return { outcome: "indeterminate", ticket: null };
      }
      if (call.replyOp === proto.OP_TIMEOUT) {
        return { outcome: "timeout", ticket: null };
      }
      if (call.replyOp === proto.OP_BUSY) {
        return { outcome: "busy", ticket: null };
      }
      if (call.replyOp === proto.OP_LIMIT_MISMATCH) {
        // Final: never retried with another limit.
        return { outcome: "limit_mismatch", ticket: null, limit: call.replyLimit };
      }
      // The handover gate: a grant seen after D is not handed to a caller
      // who was promised an answer by D.
      if (plan.now() > p.gate) {
        this.releaseInBackground(raw, key, call.replyToken);
        return { outcome: "indeterminate", ticket: null };
      }
      const ticket = new Ticket(this, key, raw, call.replyToken, leaseS, call.writtenAt);
      return { outcome: "acquired", ticket };
    }
  }

  /**
   * Acquires `key` and keeps it alive in the background (see
   * {@link Ticket.keepAlive}); throws {@link NotAcquired} when not acquired.
   * Release it with `ticket.release()` or `await using`.
   */
  async lock(key: string, options: AcquireOptions & KeepAliveOptions = {}): Promise<Ticket> {
    const res = await this.acquire(key, options);
    if (res.ticket === null) {
      throw new NotAcquired(key, res.outcome as Exclude<AcquireOutcome, "acquired">);
    }
    return res.ticket.keepAlive(options);
  }

  /**
   * Runs `fn` holding `key`, renewed in the background, and releases it when
   * `fn` settles, also when it throws. `fn` gets the ticket and its
   * `lostSignal`: once that aborts, stop using the token. Throws
   * {@link NotAcquired} when not acquired (and `fn` does not run).
   */
  async withLock<T>(
    key: string,
    fn: (ticket: Ticket, lost: AbortSignal) => Promise<T> | T,
    options: AcquireOptions & KeepAliveOptions = {},
  ): Promise<T> {
    const ticket = await this.lock(key, options);
    try {
      return await fn(ticket, ticket.lostSignal);
    } finally {
      await ticket[Symbol.asyncDispose]();
    }
  }

  /**
   * Releases `token` on `key`, from any process: locks belong to tokens,
   * not connections. Waits at most the 5 s transport deadline.
   */
  release(key: string, token: bigint, options: { signal?: AbortSignal } = {}): Promise<ReleaseOutcome> {
    const raw = plan.checkKey(key, this.maxKeyBytes);
    plan.checkToken(token);
    this.checkOpen();
    return this.releaseRaw(raw, key, token, options.signal);
  }

  /**
   * Extends the grant `token` of `key` to live `lease` seconds from about
   * now, from any process, under the 5 s transport deadline (protocol 1.1).
   */
  async extend(
    key: string,
    token: bigint,
    lease: number,
    options: { signal?: AbortSignal } = {},
  ): Promise<ExtendTokenOutcome> {
    const raw = plan.checkKey(key, this.maxKeyBytes);
    plan.checkToken(token);
    const leaseS = plan.checkLease(lease);
    this.checkOpen();
    const until = plan.now() + plan.TRANSPORT_DEADLINE_MS;
    const got = await this.extendAttempts(raw, key, token, leaseS, until, options.signal);
    if (got === "x") {
      return "not_held";
    }
    return got === "no_answer" ? "indeterminate" : "extended";
  }

  /**
   * Closes the connections. Calls in flight end (`"indeterminate"` where
   * they may have been sent); later calls throw. Held locks end with their
   * leases.
   */
  close(): void {
    this.pool.close();
  }

  private checkOpen(): void {
    if (this.pool.closed) {
      throw new Error("the client is closed");
    }
  }

  /** @internal */
  async releaseRaw(raw: Buffer, key: string, token: bigint, signal?: AbortSignal): Promise<ReleaseOutcome> {
    const p = plan.transportPlan(plan.now());
    const pause = new RetryPause(p.sendDeadline, signal);
    for (;;) {
      const session = await this.pool.get(p.sendDeadline, signal);
      if (session === null) {
        return "indeterminate";
      }
      const call = new Call("release", raw, key, p, 0n, token, 0);
      const outcome = await runWithSignal(session, call, signal);
      if (outcome === "not_sent") {
        await pause.pause();
        continue;
      }
      if (outcome === "lost") {
        return "indeterminate";
      }
      return call.replyOp === proto.OP_RELEASE ? "released" : "not_held";
    }
  }

  /** @internal */
  releaseInBackground(raw: Buffer, key: string, token: bigint): void {
    if (this.pool.closed) {
      return;
    }
    this.backgroundReleases += 1;
    void this.releaseRaw(raw, key, token).finally(() => {
      this.backgroundReleases -= 1;
    });
  }

  /** @internal */
  async extendAttempts(
    raw: Buffer,
    key: string,
    token: bigint,
    leaseS: number,
    until: number,
    stop?: AbortSignal,
  ): Promise<number | "x" | "no_answer"> {
    const pause = new RetryPause(until, stop);
    for (;;) {
      const at = plan.now();
      if (at >= until || this.pool.closed || stop?.aborted) {
        return "no_answer";
      }
      const p = plan.extendPlan(at, until);
      const session = await this.pool.get(p.sendDeadline, stop);
      if (session !== null) {
        const call = new Call("extend", raw, key, p, 0n, token, leaseS);
        if ((await runWithSignal(session, call, stop)) === "answered") {
          if (call.replyOp === proto.OP_NOT_EXTENDED) {
            return "x";
          }
          if (plan.now() < until) {
            return call.writtenAt;
          }
        }
      }
      // Not sent, sent into a connection that died, no reply in time, or
      // an E too late to count: sent again after a pause.
      await pause.pause();
    }
  }
}

/** Runs `call` on `session`; an abort of `signal` gives the call up. */
async function runWithSignal(session: Session, call: Call, signal?: AbortSignal): Promise<CallOutcome> {
  if (signal === undefined) {
    return session.run(call);
  }
  if (signal.aborted) {
    return "not_sent";
  }
  const onAbort = (): void => session.abandon(call);
  signal.addEventListener("abort", onAbort, { once: true });
  try {
    return await session.run(call);
  } finally {
    signal.removeEventListener("abort", onAbort);
  }
}

/**
 * Pauses between retries of a call whose session died: the first retry is
 * immediate, later ones back off (10 ms doubling to 500 ms), so a server
 * that accepts and drops connections does not see a connect storm. Never
 * sleeps past `until`.
 */
class RetryPause {
  private next = 0;

  constructor(
    private readonly until: number,
    private readonly signal?: AbortSignal,
  ) {}

  async pause(): Promise<void> {
    if (this.next > 0) {
      await sleepUntil(Math.min(plan.now() + this.next, this.until), this.signal);
    }
    this.next = Math.min(Math.max(this.next * 2, 10), 500);
  }
}

function intSetting(name: string, v: unknown, lo: number, hi: number): number {
  if (typeof v !== "number" || !Number.isInteger(v)) {
    throw new TypeError(`${name} must be an integer`);
  }
  if (v < lo || v > hi) {
    throw new RangeError(`${name} must be within ${lo}..=${hi}`);
  }
  return v;
}

/** The TLS settings, with the files read now. */
function tlsDial(o: ClientOptions): TlsDial | null {
  if (o.tlsServerName !== undefined && (typeof o.tlsServerName !== "string" || o.tlsServerName === "")) {
    throw new RangeError("tlsServerName must be a non-empty string");
  }
  if (o.tlsCa === undefined) {
    if (o.tlsCert !== undefined || o.tlsKey !== undefined || o.tlsServerName !== undefined) {
      throw new RangeError("a client certificate or a server name without a CA file (tlsCa)");
    }
    return null;
  }
  if ((o.tlsCert === undefined) !== (o.tlsKey === undefined)) {
    throw new RangeError("tlsCert and tlsKey go together");
  }
  const read = (what: string, path: string | undefined): Buffer | undefined => {
    if (path === undefined) {
      return undefined;
    }
    try {
      return readFileSync(path);
    } catch (e) {
      throw new RangeError(`TLS settings: cannot read ${what} ${path}: ${(e as Error).message}`);
    }
  };
  const dial: TlsDial = {
    ca: read("tlsCa", o.tlsCa) as Buffer,
    cert: read("tlsCert", o.tlsCert),
    key: read("tlsKey", o.tlsKey),
    serverName: o.tlsServerName,
  };
  try {
    // PEM that does not parse, or a key that does not match its certificate.
    new X509Certificate(dial.ca);
    if (dial.cert !== undefined && dial.key !== undefined) {
      if (!new X509Certificate(dial.cert).checkPrivateKey(createPrivateKey(dial.key))) {
        throw new Error("tlsKey is not the key of the certificate in tlsCert");
      }
    }
    createSecureContext({ ca: dial.ca, cert: dial.cert, key: dial.key });
  } catch (e) {
    throw new RangeError(`TLS settings: ${(e as Error).message}`);
  }
  return dial;
}

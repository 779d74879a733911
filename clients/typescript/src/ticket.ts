/**
 * A held lock (a *ticket*), its extension and its keep-alive (PROTOCOL §3,
 * §5.3).
 */

import { EventEmitter } from "node:events";

import { checkLease, now } from "./plan";
import { sleepUntil } from "./pool";

/** How a release ended. */
export type ReleaseOutcome = "released" | "not_held" | "indeterminate";
/** How a ticket's extend ended. */
export type ExtendOutcome = "extended" | "lost";

/** What a ticket needs of its client. */
export interface TicketHost {
  /** Releases under the transport deadline. */
  releaseRaw(keyRaw: Buffer, key: string, token: bigint, signal?: AbortSignal): Promise<ReleaseOutcome>;
  /** Releases in the background, nobody waiting. */
  releaseInBackground(keyRaw: Buffer, key: string, token: bigint): void;
  /**
   * Extends until `until`: the write time (ms) of the Extend answered `E`,
   * `"x"`, or `"no_answer"` (no `E` before `until`, or `stop` aborted).
   */
  extendAttempts(
    keyRaw: Buffer,
    key: string,
    token: bigint,
    leaseS: number,
    until: number,
    stop?: AbortSignal,
  ): Promise<number | "x" | "no_answer">;
}

/** Fires `release` of tickets the program dropped while still held. */
const dropped = new FinalizationRegistry<{ host: TicketHost; keyRaw: Buffer; key: string; token: bigint }>(
  (held) => held.host.releaseInBackground(held.keyRaw, held.key, held.token),
);

/** Options of {@link Ticket.keepAlive}. */
export interface KeepAliveOptions {
  /** Seconds between renewals, counted from the write of the last one (default lease / 3). */
  renewEvery?: number;
}

/**
 * A lock this process holds, as granted by the server.
 *
 * Pass {@link token} to the resource you guard: tokens only grow, so the
 * resource can reject a request carrying a token lower than one it has seen.
 * {@link expiresAt} is conservative: the moment the acquire (or the last
 * extend answered `E`) was handed to the socket, plus the lease, so the
 * server's lease always ends later.
 *
 * The ticket emits `"lost"` (once) and aborts {@link lostSignal} the moment
 * it is known lost: an extend answered `X`, or no renewal of its keep-alive
 * answered by the renewal deadline. A holder told "lost" must stop using the
 * token. A ticket that is garbage collected while still held is released in
 * the background.
 */
export class Ticket extends EventEmitter {
  private leaseS: number;
  private expiry: number;
  private renewedAt: number;
  private released = false;
  private readonly lostCtl = new AbortController();
  /** Holds extends of this ticket one at a time (the caller's and the keep-alive's). */
  private extendChain: Promise<unknown> = Promise.resolve();
  private renewal: { stop: AbortController; loop: Promise<void> } | null = null;
  private readonly unregister = {};

  /** @internal */
  constructor(
    private readonly host: TicketHost,
    /** The key this ticket holds. */
    readonly key: string,
    private readonly keyRaw: Buffer,
    /** The fencing token of the grant (an extension keeps it). */
    readonly token: bigint,
    leaseS: number,
    writtenAt: number,
  ) {
    super();
    this.leaseS = leaseS;
    this.renewedAt = writtenAt;
    this.expiry = writtenAt + leaseS * 1000;
    dropped.register(this, { host, keyRaw, key, token }, this.unregister);
  }

  /** The lease, in seconds, of the grant or of its last extension. */
  get lease(): number {
    return this.leaseS;
  }

  /** When the lock must be considered lost, in ms on `performance.now()`. */
  get expiresAt(): number {
    return this.expiry;
  }

  /** Milliseconds left until {@link expiresAt}, 0 once it has passed. */
  remainingMs(): number {
    return Math.max(0, this.expiry - now());
  }

  /** Whether {@link expiresAt} has passed. */
  isExpired(): boolean {
    return now() >= this.expiry;
  }

  /** Aborted (with a reason) the moment the ticket is known lost. */
  get lostSignal(): AbortSignal {
    return this.lostCtl.signal;
  }

  /** Whether the token must not be used any more: lost, or expired. */
  isLost(): boolean {
    return this.lostCtl.signal.aborted || this.isExpired();
  }

  /**
   * Renews the grant for `lease` seconds (default: the current lease); needs
   * a protocol 1.1 server. `"extended"`: the expiry is now the time the
   * answered Extend was written plus `lease`. `"lost"`: an `X`, or no `E`
   * before the current expiry; once lost, always lost. A lease shorter than
   * the time left counts at once, answered or not. Bad arguments throw
   * before anything is sent, and nothing is sent once the expiry has passed.
   */
  extend(lease?: number): Promise<ExtendOutcome> {
    const leaseS = lease === undefined ? this.leaseS : checkLease(lease);
    return this.serial(async () => {
      const at = now();
      // A shorter lease may take effect on the server before its answer
      // comes back: from now on the expiry is no later than now + lease.
      if (!this.lostCtl.signal.aborted && at < this.expiry) {
        this.expiry = Math.min(this.expiry, at + leaseS * 1000);
      }
      return this.extendLocked(leaseS, this.expiry);
    });
  }

  private serial<T>(f: () => Promise<T>): Promise<T> {
    const run = this.extendChain.then(f, f);
    this.extendChain = run.catch(() => undefined);
    return run;
  }

  private async extendLocked(leaseS: number, until: number, stop?: AbortSignal): Promise<ExtendOutcome> {
    if (this.released) {
      return "lost";
    }
    if (this.lostCtl.signal.aborted || now() >= this.expiry) {
      this.markLost("the ticket expired before it was extended");
      return "lost";
    }
    const got = await this.host.extendAttempts(this.keyRaw, this.key, this.token, leaseS, until, stop);
    if (stop?.aborted) {
      return "lost";
    }
    if (got === "x") {
      this.markLost("the server answered X: the grant is gone");
      return "lost";
    }
    if (got === "no_answer") {
      this.markLost("no extension was answered before the deadline");
      return "lost";
    }
    // Counted from the write, never from the reply.
    this.renewedAt = got;
    this.expiry = got + leaseS * 1000;
    this.leaseS = leaseS;
    return "extended";
  }

  /** @internal */
  markLost(why: string): void {
    if (!this.lostCtl.signal.aborted) {
      this.lostCtl.abort(new Error(`lock ${JSON.stringify(this.key)} lost: ${why}`));
      this.emit("lost", this.lostCtl.signal.reason);
    }
  }

  /**
   * Renews the ticket in the background with its lease, every `renewEvery`
   * seconds (default a third of the lease) counted from the write of the
   * grant or of the last extension. The ticket is lost (event `"lost"`,
   * {@link lostSignal}) on an `X`, or when no renewal is answered by the
   * renewal deadline, a tenth of the lease before the expiry, so the holder
   * hears of it while the lease still runs. Returns the ticket.
   */
  keepAlive(options: KeepAliveOptions = {}): this {
    if (this.renewal !== null || this.released) {
      return this;
    }
    const every = options.renewEvery ?? this.leaseS / 3;
    if (typeof every !== "number" || !(every > 0) || !Number.isFinite(every)) {
      throw new RangeError("renewEvery must be a number of seconds above zero");
    }
    const stop = new AbortController();
    this.renewal = { stop, loop: this.renewLoop(every * 1000, stop.signal) };
    return this;
  }

  private async renewLoop(everyMs: number, stop: AbortSignal): Promise<void> {
    while (!stop.aborted && !this.released && !this.lostCtl.signal.aborted) {
      // Not a reason on its own to keep the process running.
      if (!(await sleepUntil(this.renewedAt + everyMs, stop, true))) {
        return;
      }
      await this.serial(async () => {
        const until = this.expiry - (this.leaseS * 1000) / 10;
        if (stop.aborted || this.released) {
          return;
        }
        if (now() >= until) {
          this.markLost("no renewal was answered by the renewal deadline");
          return;
        }
        await this.extendLocked(this.leaseS, until, stop);
      });
    }
  }

  /** Stops the keep-alive (if any); the lock stays held until its lease ends. */
  async stopRenewing(): Promise<void> {
    const r = this.renewal;
    if (r !== null) {
      r.stop.abort();
      await r.loop;
    }
  }

  /**
   * Stops the keep-alive and releases the lock, waiting for the outcome (at
   * most the 5 s transport deadline). `"indeterminate"` also covers "no
   * server reachable, nothing sent": the lease ends the lock then.
   */
  async release(options: { signal?: AbortSignal } = {}): Promise<ReleaseOutcome> {
    this.released = true;
    dropped.unregister(this.unregister);
    await this.stopRenewing();
    return this.host.releaseRaw(this.keyRaw, this.key, this.token, options.signal);
  }

  /**
   * Stops managing the lock without releasing it; the lease, or
   * `client.release(key, token)`, ends it.
   */
  async detach(): Promise<{ key: string; token: bigint }> {
    dropped.unregister(this.unregister);
    await this.stopRenewing();
    return { key: this.key, token: this.token };
  }

  /**
   * For `await using`: releases the lock. A ticket already lost is released
   * in the background (the server may be gone), without waiting.
   */
  async [Symbol.asyncDispose](): Promise<void> {
    if (this.released) {
      return;
    }
    if (this.isLost()) {
      this.released = true;
      dropped.unregister(this.unregister);
      await this.stopRenewing();
      this.host.releaseInBackground(this.keyRaw, this.key, this.token);
      return;
    }
    await this.release();
  }

  override toString(): string {
    return `Ticket(key=${JSON.stringify(this.key)}, token=${this.token}, lease=${this.leaseS})`;
  }
}

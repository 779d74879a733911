/**
 * One connection to a server (a *session*): requests from every caller are
 * pipelined on it and replies are matched by content (PROTOCOL §1, §3, §6):
 * Acquired, Timeout, Busy and LimitMismatch by owner; Released and
 * NotReleased by token and key; Extended and NotExtended by token and key.
 *
 * A call waits in the session's queue until the next flush. Until then not
 * one byte of it has reached the socket: if the session dies meanwhile, the
 * call ends `NOT_SENT` and the client may try it on another session. A flush
 * marks each call *may have been sent* (computing an acquire's wire wait at
 * that moment) before its bytes go to the socket; from then on a call whose
 * session dies ends `LOST`.
 */

import type { Socket } from "node:net";

import * as proto from "./proto";
import { Plan, now } from "./plan";

/** What a call asks for. */
export type CallKind = "acquire" | "release" | "extend";

/** How a call ended on its session. */
export type CallOutcome =
  /** A reply matched it: see `replyOp` and `replyToken`. */
  | "answered"
  /** Definitely not sent: not one byte of it reached a socket. */
  | "not_sent"
  /** It may have been sent and no reply can be matched to it any more. */
  | "lost";

/** Flushes write at most this many bytes at once. */
const BATCH_BYTES = 16 * 1024;
/** Unsent bytes the socket may hold before the session stops flushing. */
const WRITE_HIGH_WATER = 64 * 1024;

/** One request on one session, with its plan and, once ended, its reply. */
export class Call {
  phase: "queued" | "sent" | "done" = "queued";
  /** When it was handed to the socket (`now()` ms). */
  writtenAt = 0;
  replyOp = 0;
  replyToken = 0n;
  /** The key's limit an L carried (protocol 1.2). */
  replyLimit = 0;
  /** Given up by its caller while possibly sent: a reply is still absorbed. */
  abandoned = false;
  timer: NodeJS.Timeout | null = null;
  session: Session | null = null;
  private settle: ((o: CallOutcome) => void) | null = null;
  /** Settles once, with how the call ended. */
  readonly done: Promise<CallOutcome>;

  constructor(
    readonly kind: CallKind,
    readonly keyRaw: Buffer,
    readonly key: string,
    readonly plan: Plan,
    readonly owner: bigint,
    readonly token: bigint,
    readonly leaseS: number,
    /**
     * An acquire with places (protocol 1.2): the key's limit and the mode
     * byte, sent as P; `null` for a plain acquire, sent as A.
     */
    readonly places: { limit: number; mode: number } | null = null,
  ) {
    this.done = new Promise((resolve) => {
      this.settle = resolve;
    });
  }

  /** The reply-matching key of a release or an extend. */
  matchKey(): string {
    return matchKey(this.token, this.key);
  }

  finish(outcome: CallOutcome): void {
    if (this.timer !== null) {
      clearTimeout(this.timer);
      this.timer = null;
    }
    this.phase = "done";
    const s = this.settle;
    this.settle = null;
    if (s !== null) {
      s(outcome);
    }
  }

  /** Settles the caller's promise but keeps the call registered (abandoned). */
  settleOnly(outcome: CallOutcome): void {
    const s = this.settle;
    this.settle = null;
    if (s !== null) {
      s(outcome);
    }
  }
}

function matchKey(token: bigint, key: string): string {
  return `${token}\n${key}`;
}

/** What a session tells its owner (the pool and the client). */
export interface SessionHooks {
  /** A grant nobody waits for (or a caller gave up on): release it. */
  orphanGrant(key: string, token: bigint): void;
  /** The session died; `why` says how. */
  died(session: Session, why: string, failure: boolean): void;
}

/** One connection, its queue of unsent calls and its calls in flight. */
export class Session {
  dead = false;
  private readonly queue: Call[] = [];
  private readonly acquires = new Map<bigint, Call>();
  private readonly releases = new Map<string, Call[]>();
  private readonly extends = new Map<string, Call[]>();
  private inFlight = 0;
  private flushScheduled = false;
  private waitingDrain = false;
  private pending: Buffer | null = null;
  private readonly maxReply: number;

  constructor(
    private readonly socket: Socket,
    private readonly maxKeyBytes: number,
    /** The address, as given, for messages. */
    readonly peer: string,
    private readonly hooks: SessionHooks,
  ) {
    this.maxReply = proto.maxReplyBytes(maxKeyBytes);
    socket.on("data", (chunk: Buffer) => this.onData(chunk));
    socket.on("drain", () => {
      this.waitingDrain = false;
      this.flush();
    });
    socket.on("error", (e: Error) => this.close(`connection error: ${e.message}`, true));
    socket.on("end", () => this.close("the server closed the connection", true));
    socket.on("close", () => this.close("the connection closed", true));
    socket.unref();
  }

  /** Queues `call`; `false` if the session is dead (nothing was queued). */
  submit(call: Call): boolean {
    if (this.dead) {
      return false;
    }
    call.session = this;
    this.queue.push(call);
    this.arm(call, call.plan.sendDeadline);
    this.busy();
    if (!this.flushScheduled) {
      this.flushScheduled = true;
      process.nextTick(() => this.flush());
    }
    return true;
  }

  /** Queues `call` and waits for how it ends on this session. */
  run(call: Call): Promise<CallOutcome> {
    if (!this.submit(call)) {
      return Promise.resolve("not_sent");
    }
    return call.done;
  }

  /**
   * The caller gives up on `call`: unsent, it leaves the queue (`not_sent`);
   * possibly sent, the caller is told `lost` at once while the call stays
   * registered, so that its reply is still matched (a grant then is given
   * back) and the give-up deadline still applies.
   */
  abandon(call: Call): void {
    if (call.phase === "queued") {
      const i = this.queue.indexOf(call);
      if (i >= 0) {
        this.queue.splice(i, 1);
      }
      call.finish("not_sent");
      this.idleCheck();
    } else if (call.phase === "sent") {
      call.abandoned = true;
      call.settleOnly("lost");
    }
  }

  private arm(call: Call, at: number): void {
    if (call.timer !== null) {
      clearTimeout(call.timer);
    }
    call.timer = setTimeout(() => this.onDeadline(call), Math.max(0, at - now()) + 1);
  }

  private onDeadline(call: Call): void {
    call.timer = null;
    if (call.phase === "queued") {
      // Still unsent at its send deadline: withdrawn, never written.
      if (now() < call.plan.sendDeadline) {
        this.arm(call, call.plan.sendDeadline);
        return;
      }
      this.abandon(call);
    } else if (call.phase === "sent") {
      if (now() < call.plan.giveUp) {
        this.arm(call, call.plan.giveUp);
        return;
      }
      // Possibly sent, no reply by the give-up deadline: close exactly
      // this session (PROTOCOL §3).
      this.close(`no reply from ${this.peer} by the call's deadline; connection closed`, true);
    }
  }

  private busy(): void {
    this.socket.ref();
  }

  private idleCheck(): void {
    if (this.queue.length === 0 && this.inFlight === 0) {
      this.socket.unref();
    }
  }

  /** Writes what is queued, in batches, while the socket takes it. */
  private flush(): void {
    this.flushScheduled = false;
    while (!this.dead && !this.waitingDrain && this.queue.length > 0) {
      const parts: Buffer[] = [];
      let size = 0;
      while (this.queue.length > 0 && size < BATCH_BYTES) {
        const call = this.queue.shift() as Call;
        const frame = this.register(call);
        if (frame !== null) {
          parts.push(frame);
          size += frame.length;
        }
      }
      if (parts.length > 0) {
        this.socket.write(parts.length === 1 ? (parts[0] as Buffer) : Buffer.concat(parts, size));
      }
      if (this.socket.writableLength > WRITE_HIGH_WATER) {
        this.waitingDrain = true;
      }
    }
    this.idleCheck();
  }

  /** Marks `call` possibly sent and returns its frame, or `null` if it is too late. */
  private register(call: Call): Buffer | null {
    const at = now();
    const wait = call.plan.wireWaitAt(at);
    if (wait === null) {
      call.finish("not_sent");
      return null;
    }
    call.phase = "sent";
    call.writtenAt = at;
    this.inFlight += 1;
    this.arm(call, call.plan.giveUp);
    switch (call.kind) {
      case "acquire":
        this.acquires.set(call.owner, call);
        if (call.places !== null) {
          const { limit, mode } = call.places;
          return proto.encodeAcquireWithLimit(wait, call.leaseS, call.owner, limit, mode, call.keyRaw);
        }
        return proto.encodeAcquire(wait, call.leaseS, call.owner, call.keyRaw);
      case "release":
        push(this.releases, call.matchKey(), call);
        return proto.encodeRelease(call.token, call.keyRaw);
      case "extend":
        push(this.extends, call.matchKey(), call);
        return proto.encodeExtend(call.leaseS, call.token, call.keyRaw);
    }
  }

  private onData(chunk: Buffer): void {
    if (this.dead) {
      return;
    }
    let buf = this.pending === null ? chunk : Buffer.concat([this.pending, chunk]);
    let at = 0;
    for (;;) {
      const d = proto.decodeReply(buf, at, this.maxKeyBytes);
      if (d === null) {
        break;
      }
      if (d.kind === "malformed") {
        this.close(`malformed reply from ${this.peer}: ${d.reason}; connection closed`, true);
        return;
      }
      at += d.used;
      this.deliver(d.reply);
      if (this.dead) {
        return;
      }
    }
    buf = buf.subarray(at);
    // A partial frame is at most one maximal reply (decodeReply guarantees
    // it finds a malformed stream before that); copy it so that the chunk
    // it came from is not kept alive.
    this.pending = buf.length === 0 ? null : Buffer.from(buf.subarray(0, this.maxReply));
    this.idleCheck();
  }

  private deliver(r: proto.Reply): void {
    let call: Call | undefined;
    switch (r.op) {
      case proto.OP_ACQUIRE:
      case proto.OP_TIMEOUT:
      case proto.OP_BUSY:
      case proto.OP_LIMIT_MISMATCH: {
        const owner = r.op === proto.OP_ACQUIRE ? r.owner : r.a;
        call = this.acquires.get(owner);
        if (call !== undefined) {
          this.acquires.delete(owner);
        }
        break;
      }
      case proto.OP_RELEASE:
      case proto.OP_NOT_RELEASED:
        call = shift(this.releases, matchKey(r.a, r.key));
        break;
      default:
        call = shift(this.extends, matchKey(r.a, r.key));
    }
    if (call === undefined) {
      if (r.op === proto.OP_ACQUIRE) {
        // A grant for an owner nobody waits for: give it back at once.
        this.hooks.orphanGrant(r.key, r.a);
      }
      return;
    }
    this.inFlight -= 1;
    if (r.op === proto.OP_LIMIT_MISMATCH && call.places === null) {
      // An L answers only an Acquire With Limit: a server that sends one
      // for an A cannot be trusted with this call or this connection.
      call.finish("lost");
      this.close(`LimitMismatch reply to a plain acquire from ${this.peer}; connection closed`, true);
      return;
    }
    call.replyOp = r.op;
    call.replyToken = r.a;
    call.replyLimit = r.limit ?? 0;
    if (call.abandoned && r.op === proto.OP_ACQUIRE) {
      this.hooks.orphanGrant(r.key, r.a);
    }
    call.finish("answered");
  }

  /** Whether anything is queued or in flight here. */
  get idle(): boolean {
    return this.queue.length === 0 && this.inFlight === 0;
  }

  /**
   * Ends the session: unsent calls end `not_sent` (the client may send them
   * elsewhere), calls that may have been sent end `lost`.
   */
  close(why: string, failure: boolean): void {
    if (this.dead) {
      return;
    }
    this.dead = true;
    this.pending = null;
    this.socket.destroy();
    const queued = this.queue.splice(0);
    for (const c of queued) {
      c.finish("not_sent");
    }
    const sent: Call[] = [...this.acquires.values()];
    for (const list of [...this.releases.values(), ...this.extends.values()]) {
      sent.push(...list);
    }
    this.acquires.clear();
    this.releases.clear();
    this.extends.clear();
    this.inFlight = 0;
    for (const c of sent) {
      c.finish("lost");
    }
    this.hooks.died(this, why, failure && sent.length + queued.length > 0);
  }
}

function push(m: Map<string, Call[]>, k: string, c: Call): void {
  const list = m.get(k);
  if (list === undefined) {
    m.set(k, [c]);
  } else {
    list.push(c);
  }
}

function shift(m: Map<string, Call[]>, k: string): Call | undefined {
  const list = m.get(k);
  if (list === undefined) {
    return undefined;
  }
  const c = list.shift();
  if (list.length === 0) {
    m.delete(k);
  }
  return c;
}

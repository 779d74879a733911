/**
 * Deadline arithmetic and argument checks of one call (PROTOCOL §3, §5.3),
 * kept apart from sockets so every rule can be checked with made-up instants.
 *
 * Instants are milliseconds on `performance.now()` (monotonic). An acquire
 * with `wait > 0` has one deadline `D = start + normalised wait`: it may be
 * written only before `D`, its wire wait is the time left until `D` rounded
 * *up* to whole seconds, an `A` that reaches the caller after `D` is not
 * handed over, and a request that may have been sent but has no reply by
 * `D + 1 s` is given up. `wait = 0` and releases run under a separate 5 s
 * transport deadline.
 */

import { performance } from "node:perf_hooks";

/** The longest wait the wire carries, in seconds; longer waits are clamped. */
export const MAX_WAIT_S = 255;
/** The longest lease the wire carries, in seconds. */
export const MAX_LEASE_S = 255;
/** Transport deadline of a `wait = 0` acquire, a release and an extend attempt. */
export const TRANSPORT_DEADLINE_MS = 5000;
/** How long past `D` a reply is still waited for (the wire wait was rounded up). */
export const RESPONSE_GRACE_MS = 1000;
/** The server's default `--max-key-bytes`. */
export const DEFAULT_MAX_KEY_BYTES = 1024;
/** The most any server accepts for `--max-key-bytes`. */
export const MAX_KEY_BYTES_CEILING = 65536;

/** The monotonic clock every deadline is on, in milliseconds. */
export function now(): number {
  return performance.now();
}

/**
 * The caller's wait in seconds, clamped to 0..=255. Negative, NaN and
 * non-numbers are refused (`RangeError` / `TypeError`).
 */
export function normaliseWait(wait: unknown): number {
  if (typeof wait !== "number") {
    throw new TypeError(`wait must be a number of seconds, not ${typeof wait}`);
  }
  if (Number.isNaN(wait)) {
    throw new RangeError("wait is NaN");
  }
  if (wait < 0) {
    throw new RangeError(`a wait of ${wait} s is negative`);
  }
  return Math.min(wait, MAX_WAIT_S);
}

/**
 * The wait byte for `remainingMs` until `D`: whole seconds rounded up, at
 * most 255; `null` when nothing remains (must not be sent).
 */
export function wireWaitS(remainingMs: number): number | null {
  if (remainingMs <= 0) {
    return null;
  }
  return Math.min(Math.ceil(remainingMs / 1000), MAX_WAIT_S);
}

/**
 * The lease byte: whole seconds in 1..=255. A lease is never rounded: 1.5
 * is refused, not turned into 1 or 2.
 */
export function checkLease(lease: unknown): number {
  if (typeof lease !== "number") {
    throw new TypeError(`lease must be whole seconds, not ${typeof lease}`);
  }
  if (!Number.isFinite(lease) || !Number.isInteger(lease)) {
    throw new RangeError(`a lease of ${lease} s is not a whole number of seconds`);
  }
  if (lease <= 0) {
    throw new RangeError(`a lease of ${lease} s is not allowed: it must be 1..=255`);
  }
  if (lease > MAX_LEASE_S) {
    throw new RangeError(`a lease of ${lease} s is over the 255 s maximum`);
  }
  return lease;
}

/**
 * The key as the wire carries it: UTF-8, 1..=maxKeyBytes bytes, no newline.
 * Refused with `RangeError` / `TypeError` otherwise.
 */
export function checkKey(key: unknown, maxKeyBytes: number): Buffer {
  if (typeof key !== "string") {
    throw new TypeError(`key must be a string, not ${typeof key}`);
  }
  if (key.length === 0) {
    throw new RangeError("the key is empty");
  }
  if (key.includes("\n")) {
    throw new RangeError("the key contains a newline");
  }
  if (LONE_SURROGATE.test(key)) {
    throw new RangeError("the key is not valid Unicode text (a lone surrogate)");
  }
  const raw = Buffer.from(key, "utf8");
  if (raw.length > maxKeyBytes) {
    throw new RangeError(`the key is ${raw.length} bytes long, the limit is ${maxKeyBytes}`);
  }
  return raw;
}

/** Matches a UTF-16 surrogate that is not half of a pair. */
const LONE_SURROGATE = /\p{Surrogate}/u;

/** A token: a 64-bit unsigned integer, as a `bigint`. */
export function checkToken(token: unknown): bigint {
  if (typeof token !== "bigint") {
    throw new TypeError(`token must be a bigint, not ${typeof token}`);
  }
  if (token < 0n || token >= 1n << 64n) {
    throw new RangeError(`token ${token} is not a 64-bit unsigned integer`);
  }
  return token;
}

/** Every instant that governs one call. */
export class Plan {
  constructor(
    /** `D` of an acquire with `wait > 0`; `null` for the others. */
    readonly waitDeadline: number | null,
    /** Written only before this; still queued then, it is dropped unsent. */
    readonly sendDeadline: number,
    /** An `A` seen by the caller after this is not handed over. */
    readonly gate: number,
    /** Possibly sent and still unanswered at this instant: given up. */
    readonly giveUp: number,
  ) {}

  /** The wait byte to write at `at`, or `null`: must not be sent. */
  wireWaitAt(at: number): number | null {
    if (at >= this.sendDeadline) {
      return null;
    }
    if (this.waitDeadline === null) {
      return 0;
    }
    return wireWaitS(this.waitDeadline - at);
  }
}

/** The plan of an acquire that started at `start` (wait normalised, seconds). */
export function acquirePlan(start: number, waitS: number): Plan {
  if (waitS <= 0) {
    // One direct attempt under the transport deadline: no rounded-up wire
    // wait, so no grace either.
    return transportPlan(start);
  }
  const d = start + waitS * 1000;
  return new Plan(d, d, d, d + RESPONSE_GRACE_MS);
}

/** The plan of a release (or a `wait = 0` acquire) started at `start`. */
export function transportPlan(start: number): Plan {
  const t = start + TRANSPORT_DEADLINE_MS;
  return new Plan(null, t, t, t);
}

/**
 * The plan of one extend attempt made at `start`: sent, and answered, within
 * the transport deadline and never after `until` (the ticket's conservative
 * expiry, or the keep-alive's renewal deadline).
 */
export function extendPlan(start: number, until: number): Plan {
  const t = Math.min(start + TRANSPORT_DEADLINE_MS, until);
  return new Plan(null, t, t, t);
}

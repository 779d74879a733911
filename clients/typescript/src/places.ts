/**
 * Places (protocol 1.2, PROTOCOL §6): how many holders a key admits at once
 * and which of its places an acquire asks for. A counting semaphore of N is
 * a limit of N in shared mode; a read/write lock is the limit
 * {@link READ_WRITE_LIMIT}, shared for readers and exclusive for writers.
 */

import * as proto from "./proto";

/** `"shared"`: one of the key's places; `"exclusive"`: the whole key. */
export type Mode = "shared" | "exclusive";

/** The limit of a read/write lock: as many readers as the wire can count. */
export const READ_WRITE_LIMIT = proto.MAX_LIMIT;

/**
 * What an acquire with places asks for: one place of `limit` in `"shared"`
 * mode, or all of them in `"exclusive"` mode. Every caller of a key must
 * give the key's own `limit` (1..=65535).
 */
export interface Places {
  limit: number;
  mode: Mode;
}

/** The usual places: a semaphore's permit, a reader's and a writer's hold. */
export const Places = {
  /** One permit of a counting semaphore of `limit` places. */
  semaphore(limit: number): Places {
    return { limit, mode: "shared" };
  },
  /** A reader's place in a read/write lock. */
  shared(): Places {
    return { limit: READ_WRITE_LIMIT, mode: "shared" };
  },
  /** A writer's hold of a read/write lock. */
  exclusive(): Places {
    return { limit: READ_WRITE_LIMIT, mode: "exclusive" };
  },
} as const;

/**
 * The wire's `limit` and `mode` bytes of `places`. A limit of 0 (or over
 * 65535, or not whole) and an unknown mode throw `RangeError` /
 * `TypeError` before anything is sent.
 */
export function checkPlaces(places: Places): { limit: number; mode: number } {
  if (typeof places !== "object" || places === null) {
    throw new TypeError(`places must be an object, not ${places === null ? "null" : typeof places}`);
  }
  const { limit, mode } = places;
  if (typeof limit !== "number") {
    throw new TypeError(`limit must be a number, not ${typeof limit}`);
  }
  if (limit === 0) {
    throw new RangeError("a limit of 0 admits no holder: it must be 1..=65535");
  }
  if (!Number.isInteger(limit) || limit < 1 || limit > proto.MAX_LIMIT) {
    throw new RangeError(`a limit of ${limit} is not a whole number within 1..=65535`);
  }
  if (mode === "shared") {
    return { limit, mode: proto.MODE_SHARED };
  }
  if (mode === "exclusive") {
    return { limit, mode: proto.MODE_EXCLUSIVE };
  }
  throw new RangeError(`mode must be "shared" or "exclusive", not ${JSON.stringify(mode)}`);
}

/**
 * The wire codec (PROTOCOL §1, §5.1 and §6.1): requests out, replies in. No I/O.
 *
 * Every frame ends with one `0x0A` byte, and its fixed binary header may
 * contain `0x0A` itself, so a reply is decoded by taking the header by count
 * for its op and only then looking for the newline that ends the key.
 */

/** 'A': request Acquire, reply Acquired. */
export const OP_ACQUIRE = 0x41;
/** 'R': request Release, reply Released. */
export const OP_RELEASE = 0x52;
/** 'E': request Extend, reply Extended (protocol 1.1). */
export const OP_EXTEND = 0x45;
/** 'T': not granted, the key stayed held. */
export const OP_TIMEOUT = 0x54;
/** 'B': not granted and not queued, a limit stood in the way. */
export const OP_BUSY = 0x42;
/** 'N': the release changed nothing. */
export const OP_NOT_RELEASED = 0x4e;
/** 'X': the extend changed nothing (protocol 1.1). */
export const OP_NOT_EXTENDED = 0x58;
/** 'P': request Acquire With Limit (protocol 1.2). */
export const OP_ACQUIRE_WITH_LIMIT = 0x50;
/** 'L': the key is registered with another limit (protocol 1.2). */
export const OP_LIMIT_MISMATCH = 0x4c;
/** 'S': a shared place, in an Acquire With Limit. */
export const MODE_SHARED = 0x53;
/** 'X': the whole key, in an Acquire With Limit. */
export const MODE_EXCLUSIVE = 0x58;
/** The most places a key admits: the largest `limit` the wire carries. */
export const MAX_LIMIT = 65535;
const NEWLINE = 0x0a;

/** Fixed header length of each reply op, op byte included. */
const REPLY_HEADER: ReadonlyMap<number, number> = new Map([
  [OP_ACQUIRE, 17],
  [OP_TIMEOUT, 9],
  [OP_BUSY, 9],
  [OP_RELEASE, 9],
  [OP_NOT_RELEASED, 9],
  [OP_NOT_EXTENDED, 9],
  [OP_EXTEND, 9],
  [OP_LIMIT_MISMATCH, 11],
]);

/** The longest reply a reader holds for a key limit of `maxKeyBytes`. */
export function maxReplyBytes(maxKeyBytes: number): number {
  return 17 + maxKeyBytes + 1;
}

/** `'A' wait:u8 lease:u8 owner:u64 key '\n'`. */
export function encodeAcquire(waitS: number, leaseS: number, owner: bigint, key: Buffer): Buffer {
  const b = Buffer.allocUnsafe(12 + key.length);
  b[0] = OP_ACQUIRE;
  b[1] = waitS;
  b[2] = leaseS;
  b.writeBigUInt64BE(owner, 3);
  key.copy(b, 11);
  b[b.length - 1] = NEWLINE;
  return b;
}

/**
 * `'P' wait:u8 lease:u8 owner:u64 limit:u16 mode:u8 key '\n'` (protocol
 * 1.2); `mode` is {@link MODE_SHARED} or {@link MODE_EXCLUSIVE}.
 */
export function encodeAcquireWithLimit(
  waitS: number,
  leaseS: number,
  owner: bigint,
  limit: number,
  mode: number,
  key: Buffer,
): Buffer {
  const b = Buffer.allocUnsafe(15 + key.length);
  b[0] = OP_ACQUIRE_WITH_LIMIT;
  b[1] = waitS;
  b[2] = leaseS;
  b.writeBigUInt64BE(owner, 3);
  b.writeUInt16BE(limit, 11);
  b[13] = mode;
  key.copy(b, 14);
  b[b.length - 1] = NEWLINE;
  return b;
}

/** `'R' token:u64 key '\n'`. */
export function encodeRelease(token: bigint, key: Buffer): Buffer {
  const b = Buffer.allocUnsafe(10 + key.length);
  b[0] = OP_RELEASE;
  b.writeBigUInt64BE(token, 1);
  key.copy(b, 9);
  b[b.length - 1] = NEWLINE;
  return b;
}

/** `'E' lease:u8 token:u64 key '\n'` (protocol 1.1). */
export function encodeExtend(leaseS: number, token: bigint, key: Buffer): Buffer {
  const b = Buffer.allocUnsafe(11 + key.length);
  b[0] = OP_EXTEND;
  b[1] = leaseS;
  b.writeBigUInt64BE(token, 2);
  key.copy(b, 10);
  b[b.length - 1] = NEWLINE;
  return b;
}

/**
 * One decoded reply. `a` is the token for A/R/N/E/X and the owner for
 * T/B/L; `owner` is set for A only (0 otherwise); `limit`, the key's limit,
 * for L only (protocol 1.2).
 */
export interface Reply {
  op: number;
  a: bigint;
  owner: bigint;
  key: string;
  limit?: number;
}

/** What {@link decodeReply} finds at a position of the stream. */
export type Decoded =
  | { kind: "frame"; reply: Reply; used: number }
  | { kind: "malformed"; reason: string }
  | null;

const UTF8 = new TextDecoder("utf-8", { fatal: true });

/**
 * Decodes one reply at `buf[start..]`: a frame, a malformed stream, or
 * `null` if more bytes are needed. Never looks more than the header plus
 * `maxKeyBytes + 1` bytes ahead for the newline, so a stream without one is
 * found malformed after a bounded amount of input.
 */
export function decodeReply(buf: Buffer, start: number, maxKeyBytes: number): Decoded {
  if (start >= buf.length) {
    return null;
  }
  const op = buf[start] as number;
  const header = REPLY_HEADER.get(op);
  if (header === undefined) {
    return { kind: "malformed", reason: `unknown reply op 0x${op.toString(16).padStart(2, "0")}` };
  }
  if (buf.length - start < header) {
    return null;
  }
  const keyStart = start + header;
  const windowEnd = Math.min(buf.length, keyStart + maxKeyBytes + 1);
  const nl = buf.subarray(keyStart, windowEnd).indexOf(NEWLINE);
  if (nl < 0) {
    if (windowEnd - keyStart > maxKeyBytes) {
      return { kind: "malformed", reason: "reply key longer than max_key_bytes" };
    }
    return null;
  }
  if (nl === 0) {
    return { kind: "malformed", reason: "reply with an empty key" };
  }
  let key: string;
  try {
    key = UTF8.decode(buf.subarray(keyStart, keyStart + nl));
  } catch {
    return { kind: "malformed", reason: "reply key is not UTF-8" };
  }
  const a = buf.readBigUInt64BE(start + 1);
  const owner = op === OP_ACQUIRE ? buf.readBigUInt64BE(start + 9) : 0n;
  const reply: Reply = { op, a, owner, key };
  if (op === OP_LIMIT_MISMATCH) {
    reply.limit = buf.readUInt16BE(start + 9);
  }
  return { kind: "frame", reply, used: header + nl + 1 };
}

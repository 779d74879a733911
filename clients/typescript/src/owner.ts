/**
 * Fresh acquire owners (PROTOCOL §3): unique within the process, unlikely to
 * collide across processes.
 *
 * An owner is `mix(base + n)`: `base` is 64 random bits drawn once per
 * process, `n` a process-wide counter. `mix` (the splitmix64 finaliser) is a
 * bijection on 64-bit integers, so two calls in one process never share an
 * owner, and consecutive owners are spread over the range.
 */

import { randomBytes } from "node:crypto";

const MASK = (1n << 64n) - 1n;
const base = randomBytes(8).readBigUInt64BE(0);
let counter = 0n;

/** The splitmix64 finaliser: a bijection, so distinct inputs stay distinct. */
export function mix(x: bigint): bigint {
  let z = x & MASK;
  z = ((z ^ (z >> 30n)) * 0xbf58476d1ce4e5b9n) & MASK;
  z = ((z ^ (z >> 27n)) * 0x94d049bb133111ebn) & MASK;
  return z ^ (z >> 31n);
}

/** A fresh owner for one acquire call. */
export function nextOwner(): bigint {
  const n = counter;
  counter += 1n;
  return mix((base + n) & MASK);
}

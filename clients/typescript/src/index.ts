/**
 * A client for the ticketd lock server: fencing tokens, FIFO queues,
 * bounded waits, leases and their renewal, semaphores and read/write locks
 * (protocol 1.2). It follows PROTOCOL §3, §5.3 and §6.3:
 * a caller is never told `"acquired"` unless it holds the lock, and never
 * enters a critical section on a guess.
 *
 * @packageDocumentation
 */

export {
  type AcquireOptions,
  type AcquireOutcome,
  type AcquireResult,
  Client,
  type ClientOptions,
  DEFAULT_POOL_SIZE,
  type ExtendTokenOutcome,
  MAX_POOL_SIZE,
  NotAcquired,
} from "./client";
export { type Mode, Places, READ_WRITE_LIMIT } from "./places";
export { type ExtendOutcome, type KeepAliveOptions, type ReleaseOutcome, Ticket } from "./ticket";
export { MAX_LEASE_S, MAX_WAIT_S, now } from "./plan";

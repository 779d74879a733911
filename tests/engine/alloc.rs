//! The engine's hot path does not allocate, except to store a new key longer
//! than [`INLINE_KEY_BYTES`].
//!
//! A global allocator counts allocations made by the current thread only
//! (a thread-local counter), so the tests of this file can run in parallel
//! without seeing each other's allocations. After a warm-up (outbox buffers,
//! hash table capacity), an uncontended acquire + release on a fresh key
//! must not allocate at all when the key fits in the table entry, and
//! exactly once (the key it stores) when it does not. The same counter keeps the
//! live bytes, to show that churn on the contended path leaves nothing behind.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use ticketd::engine::{Acquire, AcquireOutcome, Engine, Outbox};
use ticketd::hash::INLINE_KEY_BYTES;
use ticketd::limits::EngineLimits;
use ticketd::time::Millis;

thread_local! {
    static ALLOCS: Cell<usize> = const { Cell::new(0) };
    static LIVE: Cell<isize> = const { Cell::new(0) };
}

struct PerThread;

fn count_one() {
    // `try_with`: never panic inside the allocator, even during thread exit.
    let _ = ALLOCS.try_with(|c| c.set(c.get() + 1));
}

fn count_bytes(delta: isize) {
    let _ = LIVE.try_with(|c| c.set(c.get() + delta));
}

// SAFETY: forwards to `System` unchanged; the counter is a const-initialised
// thread-local `Cell`, which never allocates.
unsafe impl GlobalAlloc for PerThread {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count_one();
        count_bytes(layout.size() as isize);
        System.alloc(layout)
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count_one();
        count_bytes(layout.size() as isize);
        System.alloc_zeroed(layout)
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        count_bytes(-(layout.size() as isize));
        System.dealloc(ptr, layout);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count_one();
        count_bytes(new_size as isize - layout.size() as isize);
        System.realloc(ptr, layout, new_size)
    }
}

#[global_allocator]
static GLOBAL: PerThread = PerThread;

fn allocs() -> usize {
    ALLOCS.with(Cell::get)
}

fn live_bytes() -> isize {
    LIVE.with(Cell::get)
}

fn key(i: u64, buf: &mut [u8; 24]) -> &str {
    buf[..4].copy_from_slice(b"key-");
    let mut n = i;
    for b in buf[4..].iter_mut().rev() {
        *b = b'0' + (n % 10) as u8;
        n /= 10;
    }
    std::str::from_utf8(buf).expect("ascii")
}

fn acq(key: &str, owner: u64, wait_s: u8) -> Acquire<'_> {
    Acquire {
        key,
        owner,
        wait_s,
        lease_s: 30,
    }
}

/// Acquire + release cycles on fresh keys of `len` bytes, after a warm-up:
/// the allocations the measured cycles made.
fn cycle_allocs(len: usize) -> usize {
    let mut e = Engine::new(EngineLimits::default(), 1);
    let mut out = Outbox::new();
    let mut buf = [0u8; 24];
    let pad = "p".repeat(len.saturating_sub(24));
    let mut cycle = |e: &mut Engine, out: &mut Outbox, i: u64| {
        let mut k = String::with_capacity(24 + pad.len());
        k.push_str(key(i, &mut buf));
        k.push_str(&pad);
        let k = &k[..len];
        let AcquireOutcome::Granted(t) = e.acquire(Millis(i), 1, acq(k, i, 0), out) else {
            panic!("a fresh key is granted");
        };
        assert!(e.release(Millis(i), 1, t, k, out));
        out.clear();
    };
    for i in 0..100 {
        cycle(&mut e, &mut out, i);
    }
    // The test's own key string: one allocation per cycle.
    let before = allocs();
    for i in 100..1_100 {
        cycle(&mut e, &mut out, i);
    }
    allocs() - before - 1_000
}

#[test]
fn an_acquire_and_release_of_a_fresh_short_key_does_not_allocate() {
    // A key of up to 30 bytes is kept in the table entry itself.
    assert_eq!(cycle_allocs(24), 0, "no allocation for a 24-byte key");
    assert_eq!(cycle_allocs(INLINE_KEY_BYTES), 0, "nor at the inline limit");
}

#[test]
fn an_acquire_and_release_of_a_fresh_long_key_allocates_only_the_key() {
    assert_eq!(
        cycle_allocs(INLINE_KEY_BYTES + 1),
        1_000,
        "one allocation per cycle: the key"
    );
    assert_eq!(cycle_allocs(200), 1_000);
}

#[test]
fn answers_that_store_nothing_do_not_allocate() {
    let mut e = Engine::new(EngineLimits::default(), 1);
    let mut out = Outbox::new();
    let mut buf = [0u8; 24];
    e.acquire(Millis(0), 1, acq(key(0, &mut buf), 1, 0), &mut out);
    // Warm the outbox with one of each reply.
    e.acquire(Millis(0), 2, acq(key(0, &mut buf), 2, 0), &mut out);
    e.release(Millis(0), 2, 99, key(0, &mut buf), &mut out);
    e.tick(Millis(0), &mut out);
    out.clear();

    let before = allocs();
    for i in 0..1_000u64 {
        // T for wait = 0 on a held key, N for a wrong token or unknown key,
        // a tick with nothing due, a disconnect of a connection with no
        // waiters.
        e.acquire(Millis(i), 2, acq(key(0, &mut buf), i, 0), &mut out);
        e.release(Millis(i), 2, 99, key(0, &mut buf), &mut out);
        e.release(Millis(i), 2, 1, key(7, &mut buf), &mut out);
        e.tick(Millis(i), &mut out);
        e.disconnect(Millis(i), 3, &mut out);
        assert_eq!(out.len(), 3);
        out.clear();
    }
    assert_eq!(allocs() - before, 0);
}

/// A client that holds a key, queues behind itself and releases, over and
/// over (two pipelined requests per cycle), must not make the engine keep
/// anything per cycle: each cycle makes and drops a queue whose timer is
/// 255 s away. Kept until their deadline, those timers (and their copies of
/// the key) would grow memory by the request rate times 255 s.
#[test]
fn queueing_and_handing_over_again_and_again_keeps_memory_flat() {
    let mut e = Engine::new(EngineLimits::default(), 1);
    let mut out = Outbox::new();
    let hold = Acquire {
        key: "k",
        owner: 0,
        wait_s: 0,
        lease_s: 255,
    };
    let AcquireOutcome::Granted(mut token) = e.acquire(Millis(0), 1, hold, &mut out) else {
        panic!("a fresh key is granted");
    };
    out.clear();
    let mut cycle = |e: &mut Engine, out: &mut Outbox, i: u64| {
        let queue = Acquire {
            owner: i,
            wait_s: 255,
            ..hold
        };
        assert!(matches!(
            e.acquire(Millis(i), 1, queue, out),
            AcquireOutcome::Queued(_)
        ));
        assert!(e.release(Millis(i), 1, token, "k", out));
        token += 1;
        e.tick(Millis(i), out);
        assert_eq!(out.len(), 2, "R, then A to the waiter");
        out.clear();
    };
    for i in 1..1_000 {
        cycle(&mut e, &mut out, i);
    }
    e.check_invariants();
    let before = live_bytes();
    for i in 1_000..11_000 {
        cycle(&mut e, &mut out, i);
    }
    let grown = live_bytes() - before;
    assert!(
        grown < 4096,
        "10,000 cycles left {grown} bytes behind in the engine"
    );
    e.check_invariants();
}

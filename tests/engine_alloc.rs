//! The engine's hot path does not allocate, except to store a new key.
//!
//! A global allocator counts allocations made by the current thread only
//! (a thread-local counter), so the tests of this file can run in parallel
//! without seeing each other's allocations. After a warm-up (outbox buffers,
//! hash table capacity), an uncontended acquire + release on a fresh key
//! must allocate exactly once: the key it stores.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use ticketd::engine::{Acquire, AcquireOutcome, Engine, Outbox};
use ticketd::limits::EngineLimits;
use ticketd::time::Millis;

thread_local! {
    static ALLOCS: Cell<usize> = const { Cell::new(0) };
}

struct PerThread;

fn count_one() {
    // `try_with`: never panic inside the allocator, even during thread exit.
    let _ = ALLOCS.try_with(|c| c.set(c.get() + 1));
}

// SAFETY: forwards to `System` unchanged; the counter is a const-initialised
// thread-local `Cell`, which never allocates.
unsafe impl GlobalAlloc for PerThread {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count_one();
        System.alloc(layout)
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count_one();
        System.alloc_zeroed(layout)
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count_one();
        System.realloc(ptr, layout, new_size)
    }
}

#[global_allocator]
static GLOBAL: PerThread = PerThread;

fn allocs() -> usize {
    ALLOCS.with(Cell::get)
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

#[test]
fn an_acquire_and_release_of_a_fresh_key_allocates_only_the_key() {
    let mut e = Engine::new(EngineLimits::default(), 1);
    let mut out = Outbox::new();
    let mut buf = [0u8; 24];
    let mut cycle = |e: &mut Engine, out: &mut Outbox, i: u64| {
        let k = key(i, &mut buf);
        let AcquireOutcome::Granted(t) = e.acquire(Millis(i), 1, acq(k, i, 0), out) else {
            panic!("a fresh key is granted");
        };
        assert!(e.release(Millis(i), 1, t, k, out));
        out.clear();
    };
    for i in 0..100 {
        cycle(&mut e, &mut out, i);
    }
    let before = allocs();
    for i in 100..1_100 {
        cycle(&mut e, &mut out, i);
    }
    assert_eq!(
        allocs() - before,
        1_000,
        "one allocation per cycle: the key"
    );
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

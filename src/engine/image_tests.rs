//! The engine's image with permit keys (PROTOCOL §6): round trips with
//! shared and exclusive grants and mixed-mode waiters, a restored engine
//! that goes on exactly as the one that wrote it, the layout without
//! permits still read, and bad bytes refused.

use super::*;
use crate::proto::Mode;

/// A tag of a `u64`, written whole; a waiter's tag names its connection
/// (`tag / 1000`). Holders and permits as the layout asks.
struct U64Codec {
    holders: bool,
    permits: bool,
}

/// The current layout: holders and permits.
const CURRENT: U64Codec = U64Codec {
    holders: true,
    permits: true,
};

/// The layout before permits: holders, no permit keys.
const BEFORE_PERMITS: U64Codec = U64Codec {
    holders: true,
    permits: false,
};

impl TagCodec<u64> for U64Codec {
    fn write_grant(&self, tag: &u64, buf: &mut Vec<u8>) {
        buf.extend_from_slice(&tag.to_be_bytes());
    }
    fn write_waiter(&self, tag: &u64, buf: &mut Vec<u8>) {
        buf.extend_from_slice(&tag.to_be_bytes());
    }
    fn read_grant(&self, r: &mut ImageReader<'_>) -> Result<u64, ImageError> {
        Ok(r.u64()?)
    }
    fn read_waiter(&self, r: &mut ImageReader<'_>) -> Result<u64, ImageError> {
        Ok(r.u64()?)
    }
    fn min_grant_bytes(&self) -> usize {
        8
    }
    fn min_waiter_bytes(&self) -> usize {
        8
    }
    fn holders(&self) -> bool {
        self.holders
    }
    fn permits(&self) -> bool {
        self.permits
    }
}

/// The connection a waiter's tag names.
fn conn_of(tag: &u64) -> Option<ConnId> {
    Some(tag / 1000)
}

/// Drives a replicated engine of `u64` tags: each acquire on connection
/// `conn` is tagged `conn * 1000 + n` and sent as holder `2 * conn` (not
/// authenticated: the token alone decides a release).
struct Driver {
    engine: Engine<u64>,
    out: Outbox<u64>,
    n: u64,
}

impl Driver {
    fn new() -> Self {
        Driver {
            engine: Engine::replicated_tagged(EngineLimits::default(), 1),
            out: Outbox::default(),
            n: 0,
        }
    }

    /// An acquire of one of `limit` places of `key` in `mode` (limit 1: a
    /// mutex's acquire), queueing for 9 s.
    fn acquire(&mut self, conn: ConnId, key: &str, limit: u16, mode: Mode) -> AcquireOutcome {
        self.n += 1;
        let tag = conn * 1000 + self.n;
        let req = Acquire {
            key,
            owner: tag,
            wait_s: 9,
            lease_s: 5,
        };
        self.engine.set_caller(Caller {
            holder: 2 * conn,
            admin: false,
        });
        let places = Places { limit, mode };
        let got =
            self.engine
                .acquire_with_limit(Millis::ZERO, conn, req, places, tag, &mut self.out);
        self.engine.set_caller(Caller::default());
        got
    }

    fn image(&self, codec: &U64Codec) -> Vec<u8> {
        let mut buf = Vec::new();
        self.engine.write_image(codec, &mut buf);
        buf
    }
}

/// Reads `bytes` whole as an image of `codec`'s layout.
fn read(bytes: &[u8], codec: &U64Codec) -> Result<Image<u64>, ImageError> {
    let mut r = ImageReader::new(bytes);
    let image = Engine::read_image(&mut r, codec, 1024)?;
    assert!(r.is_empty(), "bytes left after the image");
    Ok(image)
}

fn restore(engine: &Engine<u64>, image: &Image<u64>) -> Result<Engine<u64>, ImageError> {
    Engine::restore(EngineLimits::default(), engine.next_token(), image, conn_of)
}

/// A table of every shape: a mutex with a waiter; a semaphore of 3 full
/// of shared grants with an exclusive waiter and a shared one behind it;
/// a read/write lock held exclusively with shared, exclusive and shared
/// waiters; a semaphore with a free place and no queue.
fn every_shape() -> Driver {
    let mut d = Driver::new();
    let ok = |o: AcquireOutcome| assert!(matches!(o, AcquireOutcome::Granted(_)), "{o:?}");
    let queued = |o: AcquireOutcome| assert!(matches!(o, AcquireOutcome::Queued(_)), "{o:?}");
    ok(d.acquire(1, "mutex", 1, Mode::Exclusive));
    queued(d.acquire(2, "mutex", 1, Mode::Exclusive));
    for conn in [3, 4, 5] {
        ok(d.acquire(conn, "sem", 3, Mode::Shared));
    }
    queued(d.acquire(6, "sem", 3, Mode::Exclusive));
    queued(d.acquire(7, "sem", 3, Mode::Shared));
    ok(d.acquire(8, "rw", 4, Mode::Exclusive));
    queued(d.acquire(9, "rw", 4, Mode::Shared));
    queued(d.acquire(10, "rw", 4, Mode::Exclusive));
    queued(d.acquire(9, "rw", 4, Mode::Shared));
    ok(d.acquire(11, "spare", 2, Mode::Shared));
    d.engine.check_invariants();
    d
}

#[test]
fn permit_keys_round_trip_with_their_grants_and_the_modes_of_their_waiters() {
    let d = every_shape();
    let bytes = d.image(&CURRENT);
    let image = read(&bytes, &CURRENT).unwrap();
    let keys: Vec<&str> = image.permits.iter().map(|k| k.key.as_str()).collect();
    assert_eq!(keys, ["rw", "sem", "spare"]);
    assert_eq!(image.keys.len(), 1, "the mutex stays among the mutexes");
    let rw = &image.permits[0];
    assert_eq!(rw.limit, 4);
    assert_eq!(rw.grants.len(), 1);
    assert!(rw.grants[0].exclusive);
    assert_eq!(rw.grants[0].holder, 16);
    let modes: Vec<bool> = rw.waiters.iter().map(|w| w.shared).collect();
    assert_eq!(modes, [true, false, true]);
    let sem = &image.permits[1];
    assert_eq!(sem.limit, 3);
    assert!(sem.grants.iter().all(|g| !g.exclusive));
    let tokens: Vec<u64> = sem.grants.iter().map(|g| g.token).collect();
    assert!(tokens.windows(2).all(|w| w[0] < w[1]), "oldest first");
    let modes: Vec<bool> = sem.waiters.iter().map(|w| w.shared).collect();
    assert_eq!(modes, [false, true]);

    let back = restore(&d.engine, &image).unwrap();
    back.check_invariants();
    assert_eq!(
        back.image_bytes(),
        bytes,
        "the restored engine writes the same image"
    );
    for key in ["rw", "sem", "mutex"] {
        let shared = |e: &Engine<u64>| e.queue(key).map(|w| w.shared).collect::<Vec<_>>();
        assert_eq!(shared(&back), shared(&d.engine), "{key}");
        let grants = |e: &Engine<u64>| {
            e.grants(key)
                .map(|g| (g.token, g.holder, g.exclusive, *g.tag))
                .collect::<Vec<_>>()
        };
        assert_eq!(grants(&back), grants(&d.engine), "{key}");
    }
    assert_eq!(back.permit_limit("sem"), Some(3));
    assert_eq!(back.next_token(), d.engine.next_token());
}

impl Engine<u64> {
    /// The image in the current layout.
    fn image_bytes(&self) -> Vec<u8> {
        let mut buf = Vec::new();
        self.write_image(&CURRENT, &mut buf);
        buf
    }
}

/// The events of `out` as text, to compare two engines' (waiter ids
/// aside, which events do not carry).
fn events(out: &Outbox<u64>) -> Vec<String> {
    out.events().map(|e| format!("{e:?}")).collect()
}

#[test]
fn a_restored_engine_goes_on_exactly_as_the_one_that_wrote_its_image() {
    let mut a = every_shape();
    a.out.clear();
    let image = read(&a.image(&CURRENT), &CURRENT).unwrap();
    let mut b = Driver {
        engine: restore(&a.engine, &image).unwrap(),
        out: Outbox::default(),
        n: a.n,
    };
    let tokens = |e: &Engine<u64>, key: &str| e.grants(key).map(|g| g.token).collect::<Vec<_>>();
    // Release the semaphore's grants one by one (its exclusive waiter gets
    // the key once all are gone, then the shared one after it), expire the
    // read/write lock's exclusive grant (its first shared waiter gets a
    // place, the exclusive one waits), and time out a waiter.
    let sem = tokens(&a.engine, "sem");
    let rw = tokens(&a.engine, "rw");
    for d in [&mut a, &mut b] {
        for &t in &sem {
            d.engine.release(Millis::ZERO, 50, t, "sem", &mut d.out);
        }
        d.engine.expire(Millis::ZERO, "rw", rw[0], &mut d.out);
        let late = d.engine.find_waiter("rw", |t| t / 1000 == 10).unwrap();
        d.engine.wait_timeout(Millis::ZERO, "rw", late, &mut d.out);
        d.engine.disconnect(Millis::ZERO, 2, &mut d.out);
        d.acquire(12, "sem", 3, Mode::Shared);
        d.acquire(13, "spare", 2, Mode::Exclusive);
        d.acquire(14, "sem", 2, Mode::Shared);
        d.engine.check_invariants();
    }
    assert_eq!(events(&a.out), events(&b.out));
    assert!(
        events(&a.out).iter().any(|e| e.contains("LimitMismatch")),
        "the semaphore of 3 refused a limit of 2"
    );
    assert_eq!(a.image(&CURRENT), b.image(&CURRENT));
}

#[test]
fn the_layout_before_permits_is_read_as_a_table_without_permit_keys() {
    let mut d = Driver::new();
    d.acquire(1, "a", 1, Mode::Exclusive);
    d.acquire(2, "a", 1, Mode::Exclusive);
    d.acquire(3, "b", 1, Mode::Shared);
    let old = d.image(&BEFORE_PERMITS);
    let image = read(&old, &BEFORE_PERMITS).unwrap();
    assert!(image.permits.is_empty());
    assert_eq!(image.keys.len(), 2);
    assert!(image
        .keys
        .iter()
        .flat_map(|k| &k.waiters)
        .all(|w| !w.shared));
    let back = restore(&d.engine, &image).unwrap();
    back.check_invariants();
    assert!(back.sorted_permit_keys().is_empty());
    // The new layout of a table without permit keys is the old one and
    // an empty permit section.
    let mut new = old.clone();
    new.extend_from_slice(&0u32.to_be_bytes());
    assert_eq!(back.image_bytes(), new);
    assert_eq!(d.image(&CURRENT), new);
    // Old bytes are not a new image: the permit section is missing.
    assert_eq!(read(&old, &CURRENT), Err(ImageError::Truncated));
}

#[test]
fn bad_permit_bytes_are_refused_and_never_panic() {
    let d = every_shape();
    let bytes = d.image(&CURRENT);
    for cut in 0..bytes.len() {
        let mut r = ImageReader::new(&bytes[..cut]);
        assert!(
            Engine::read_image(&mut r, &CURRENT, 1024).is_err(),
            "cut at {cut}"
        );
    }
    // Every byte of the permit section changed to every value: refused,
    // or read and then restored or refused, never a panic.
    let start = bytes.len() - permit_section_len(&d);
    for at in start..bytes.len() {
        for b in [0u8, 1, 2, b'S', b'X', b's', 0x7F, 0xFF] {
            let mut v = bytes.clone();
            v[at] = b;
            let mut r = ImageReader::new(&v);
            if let Ok(image) = Engine::read_image(&mut r, &CURRENT, 1024) {
                if let Ok(e) = restore(&d.engine, &image) {
                    e.check_invariants();
                }
            }
        }
    }
    let image = read(&bytes, &CURRENT).unwrap();
    let refused = |edit: &dyn Fn(&mut Image<u64>)| {
        let mut bad = image.clone();
        edit(&mut bad);
        restore(&d.engine, &bad).map(|_| ())
    };
    let invalid = |what| Err(ImageError::Invalid(what));
    assert_eq!(refused(&|i| i.permits[1].limit = 1), invalid("permit key"));
    assert_eq!(
        refused(&|i| i.permits[2].grants.clear()),
        invalid("permit key")
    );
    // An exclusive grant beside shared ones, more grants than the limit,
    // a key that is a mutex and a permit key: the grants do not fit.
    let no_fit = invalid("holder does not fit the limits");
    assert_eq!(
        refused(&|i| i.permits[1].grants[1].exclusive = true),
        no_fit
    );
    assert_eq!(refused(&|i| i.permits[1].limit = 2), no_fit);
    assert_eq!(refused(&|i| i.permits[2].key = "mutex".to_owned()), no_fit);
    // A head waiter that would fit is no waiter of a settled table: a
    // shared one on the spare place.
    let fits = |i: &mut Image<u64>| {
        i.permits[2].waiters.push(WaiterImage {
            owner: 1,
            wait_s: 9,
            lease_s: 5,
            holder: 40,
            shared: true,
            tag: 20_001,
        });
    };
    assert_eq!(refused(&fits), invalid("waiter does not fit the limits"));
    // A bad mode byte: the first grant's of the first permit key.
    let mut v = bytes.clone();
    let mode_at = start + 4 + 4 + "rw".len() + 2 + 4 + 8 + 8;
    assert_eq!(v[mode_at], b'X');
    v[mode_at] = b'x';
    assert_eq!(read(&v, &CURRENT), Err(ImageError::Invalid("mode")));
}

/// The bytes of the permit section of `d`'s image: what is left after
/// the mutexes, read in the layout before permits.
fn permit_section_len(d: &Driver) -> usize {
    let bytes = d.image(&CURRENT);
    let mut r = ImageReader::new(&bytes);
    Engine::read_image(&mut r, &BEFORE_PERMITS, 1024).unwrap();
    r.rest().len()
}

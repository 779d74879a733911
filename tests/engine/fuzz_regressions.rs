//! The fuzz targets' bodies as ordinary tests.
//!
//! `ticketd_testkit::fuzz` holds the checks each cargo-fuzz target runs;
//! this file calls them too, so it can (1) replay every input the fuzzer
//! ever crashed on, as a named regression test, and (2) run each body over a
//! seeded stream of random and structured inputs, which is the smoke CI runs
//! even where cargo-fuzz is not installed.

use ticketd_testkit::fuzz as bodies;

/// xorshift64*: a tiny deterministic generator, so a failure names its seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn bytes(&mut self, max_len: usize) -> Vec<u8> {
        let len = (self.next() as usize) % (max_len + 1);
        (0..len).map(|_| self.next() as u8).collect()
    }
}

/// Random bytes biased towards the codec's interesting values: op bytes,
/// newlines, zero leases and invalid UTF-8.
fn codec_input(rng: &mut Rng) -> Vec<u8> {
    let mut v = rng.bytes(80);
    for b in v.iter_mut() {
        match rng.next() % 8 {
            0 => *b = b'\n',
            1 => *b = b"ARTBN"[(rng.next() % 5) as usize],
            2 => *b = 0,
            3 => *b = b'k',
            _ => {}
        }
    }
    v
}

fn for_seeds(name: &str, runs: u64, body: impl Fn(&mut Rng)) {
    for seed in 1..=runs {
        let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| body(&mut rng)));
        if let Err(e) = result {
            eprintln!("{name}: failed on seed {seed}");
            std::panic::resume_unwind(e);
        }
    }
}

#[test]
fn decode_request_smoke_over_seeded_inputs() {
    for_seeds("decode_request", 20_000, |rng| {
        bodies::decode_request(&codec_input(rng));
    });
}

#[test]
fn decode_reply_smoke_over_seeded_inputs() {
    for_seeds("decode_reply", 20_000, |rng| {
        bodies::decode_reply(&codec_input(rng));
    });
}

#[test]
fn engine_ops_smoke_over_seeded_inputs() {
    for_seeds("engine_ops", 3_000, |rng| {
        bodies::engine_ops(&rng.bytes(600));
    });
}

#[test]
fn engine_ops_near_the_last_token_never_panics() {
    // Mode clocked, first token u64::MAX - 1, then acquires on every key:
    // the engine must answer Busy once tokens run out, never panic.
    let mut input = vec![0, 3, 7, 3, 0, 0, 2, 1, 0, 0];
    for key in 0..3u8 {
        input.extend_from_slice(&[0, key, 0, 1, 0, 1, 3]);
    }
    bodies::engine_ops(&input);
}

#[test]
fn engine_permits_smoke_over_seeded_inputs() {
    for_seeds("engine_permits", 3_000, |rng| {
        bodies::engine_permits(&rng.bytes(600));
    });
}

/// Replays every file in `fuzz/regressions/TARGET/` through its body.
fn replay(target: &str, body: fn(&[u8])) -> usize {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/regressions")
        .join(target);
    let mut n = 0;
    for entry in std::fs::read_dir(&dir).expect("regressions directory") {
        let path = entry.expect("directory entry").path();
        let bytes = std::fs::read(&path).expect("regression input");
        let result = std::panic::catch_unwind(|| body(&bytes));
        if let Err(e) = result {
            eprintln!("{target}: regression {} fails", path.display());
            std::panic::resume_unwind(e);
        }
        n += 1;
    }
    n
}

#[test]
fn every_saved_fuzz_input_still_passes() {
    assert!(replay("decode_request", bodies::decode_request) >= 1);
    assert!(replay("decode_reply", bodies::decode_reply) >= 1);
    assert!(replay("engine_ops", bodies::engine_ops) >= 1);
    assert!(replay("engine_permits", bodies::engine_permits) >= 1);
    #[cfg(feature = "cluster")]
    {
        assert!(replay("peer_decode", bodies::cluster::peer_decode) >= 1);
        assert!(replay("wal_recovery", bodies::cluster::wal_recovery) >= 1);
    }
}

#[cfg(feature = "cluster")]
#[test]
fn peer_decode_smoke_over_seeded_inputs() {
    for_seeds("peer_decode", 20_000, |rng| {
        let mut input = rng.bytes(120);
        if let Some(len) = input.get_mut(49..53) {
            // Mostly small frame lengths after the synthetic hello.
            len.copy_from_slice(&((rng.next() % 40) as u32).to_be_bytes());
        }
        bodies::cluster::peer_decode(&input);
    });
}

#[cfg(feature = "cluster")]
#[test]
fn wal_recovery_smoke_over_seeded_inputs() {
    for_seeds("wal_recovery", 3_000, |rng| {
        bodies::cluster::wal_recovery(&rng.bytes(200));
    });
}

//! Every program in `examples/` runs, and does what its doc comment says.
//!
//! Each test starts the example as a real process (and, for the examples
//! that talk to a server, a real `ticketd` beside it) and asserts on what it
//! prints. The benchmarks' programs are tested in bench/.
//!
//! Each example is built with `cargo build --example` before its first run
//! (`ticketd_testkit::process::workspace_example`), with the features this
//! test binary has, so the binary a test runs is never older than its
//! source; when it is fresh the build is a no-op.

use ticketd_testkit::process as common;

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::{finish, Ticketd};

/// The path of example `name`, built first with this test binary's
/// features, so it is never stale.
fn example(name: &str) -> PathBuf {
    let features: Vec<&str> = [
        ("default", cfg!(feature = "default")),
        ("server", cfg!(feature = "server")),
        ("client", cfg!(feature = "client")),
        ("cluster", cfg!(feature = "cluster")),
        ("harness", cfg!(feature = "harness")),
        ("testkit", cfg!(feature = "testkit")),
    ]
    .into_iter()
    .filter_map(|(f, on)| on.then_some(f))
    .collect();
    common::workspace_example(name, &features)
}

/// Runs example `name` with `args` to its end (at most `limit`) and returns
/// its standard output; panics with both streams if it fails.
fn run(name: &str, args: &[&str], envs: &[(&str, String)], limit: Duration) -> String {
    let mut cmd = Command::new(example(name));
    cmd.args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in envs {
        cmd.env(k, v);
    }
    let out = finish(cmd.spawn().expect("start the example"), limit);
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "example {name} failed: {}\nstdout:\n{stdout}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// The number right after `prefix` in the line that contains it.
fn number_after(text: &str, prefix: &str) -> u64 {
    let at = text
        .find(prefix)
        .unwrap_or_else(|| panic!("{prefix:?} not in:\n{text}"));
    let digits: String = text[at + prefix.len()..]
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    digits
        .parse()
        .unwrap_or_else(|_| panic!("no number after {prefix:?} in:\n{text}"))
}

/// `needles` occur in `text` in this order.
fn assert_in_order(text: &str, needles: &[&str]) {
    let mut from = 0;
    for n in needles {
        match text[from..].find(n) {
            Some(i) => from += i + n.len(),
            None => panic!("{n:?} missing (or out of order) in:\n{text}"),
        }
    }
}

#[test]
fn step_server_hands_the_key_to_the_waiter_one_millisecond_past_the_lease() {
    let out = run("step_server", &[], &[], Duration::from_secs(60));
    let holder = number_after(&out, "holder  <- Some(\"A token=");
    let waiter = number_after(&out, "waiter  <- Some(\"A token=");
    assert_eq!(holder >> ticketd::token::RANDOM_BITS, 1, "{out}");
    assert_eq!(waiter >> ticketd::token::RANDOM_BITS, 2, "{out}");
    assert_in_order(
        &out,
        &[
            &format!("holder  <- Some(\"A token={holder} owner=1 db\")"),
            "waiter  <- None (queued)",
            "clock moved 5,000 ms",
            "waiter  <- None (still queued)",
            "clock moved 1 ms more",
            &format!("waiter  <- Some(\"A token={waiter} owner=2 db\")"),
            "stopped after",
        ],
    );
}

#[test]
fn acquire_release_takes_works_under_and_releases_the_lock() {
    let server = Ticketd::start(&[]);
    let addr = server.addr().to_string();
    let out = run("acquire_release", &[&addr], &[], Duration::from_secs(60));
    assert_in_order(
        &out,
        &[
            "acquired \"db-migration\" with fencing token ",
            "step 1",
            "step 2",
            "step 3",
            "released",
        ],
    );
    assert!(number_after(&out, "fencing token ") > 0, "{out}");
}

#[test]
fn fenced_write_refuses_the_stale_holder_after_its_lease_ends() {
    let server = Ticketd::start(&[]);
    let addr = server.addr().to_string();
    let out = run("fenced_write", &[&addr], &[], Duration::from_secs(60));
    let a = number_after(&out, "A wrote with token ");
    let b = number_after(&out, "B wrote with token ");
    assert!(b > a, "the next holder's token is higher: {out}");
    assert_in_order(
        &out,
        &[
            &format!("A's write refused: stale token {a}: {b} has been seen"),
            "stored value: \"B: final\"",
        ],
    );
}

#[test]
fn shared_client_counts_every_increment_under_one_lock() {
    let server = Ticketd::start(&[]);
    let addr = server.addr().to_string();
    let out = run("shared_client", &[&addr], &[], Duration::from_secs(120));
    assert_eq!(
        number_after(&out, "8 threads x 50 increments under one lock = "),
        400,
        "{out}"
    );
}

#[test]
fn client_bench_counts_granted_and_released_cycles_of_its_threads() {
    let server = Ticketd::start(&[]);
    let addr = server.addr().to_string();
    let out = run(
        "client_bench",
        &[&addr, "4", "0.5"],
        &[],
        Duration::from_secs(120),
    );
    assert!(out.contains("threads 4"), "{out}");
    assert!(number_after(&out, "cycles/s ") > 0, "{out}");
}

#[test]
fn engine_memory_hot_path_allocates_nothing_for_a_short_key_and_leaks_nothing() {
    let out = run(
        "engine_memory",
        &["hot-path"],
        &[],
        Duration::from_secs(120),
    );
    assert!(
        out.contains(
            "0.000 allocations per cycle (a 24-byte key is stored in place), 0 bytes left behind"
        ),
        "{out}"
    );
}

#[cfg(feature = "harness")]
#[test]
fn deterministic_test_hands_the_crashed_holders_key_over_with_a_higher_token() {
    let out = run("deterministic_test", &[], &[], Duration::from_secs(60));
    let alice = number_after(&out, "0ms alice acquired db, token ");
    let bob = number_after(&out, "5001ms bob acquired db, token ");
    // Tokens: sequence steps 1 and 2, random low bits (seeded: repeatable).
    assert_eq!(alice >> ticketd::token::RANDOM_BITS, 1, "{out}");
    assert_eq!(bob >> ticketd::token::RANDOM_BITS, 2, "{out}");
    assert_in_order(
        &out,
        &[
            &format!("0ms alice acquired db, token {alice}\n"),
            "0ms bob queued for db\n",
            "0ms alice crashed holding db\n",
            "5000ms bob still waiting\n",
            &format!("5001ms bob acquired db, token {bob} (> {alice}), expires at 30000ms\n"),
            &format!("5001ms a write fenced with alice's token {alice} is refused: true\n"),
            "5001ms bob released db\n",
            "two runs, identical transcripts\n",
        ],
    );
    // "Runs in milliseconds": both runs together, timed by the example
    // (about 1 ms in a debug build; the bound leaves room for a loaded
    // machine).
    let took_us = number_after(&out, "(both runs took ");
    assert!(took_us < 250_000, "{took_us} us: {out}");
}

#[test]
fn examples_directory_has_a_test_for_every_example() {
    let me = include_str!("examples.rs");
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("examples");
    for entry in std::fs::read_dir(dir).expect("examples/") {
        let path = entry.expect("entry").path();
        if path.extension().and_then(|e| e.to_str()) != Some("rs") {
            continue;
        }
        let name = path.file_stem().and_then(|s| s.to_str()).expect("a name");
        assert!(
            me.contains(&format!("\"{name}\"")),
            "examples/{name}.rs is run by no test in tests/server/examples.rs"
        );
    }
}

/// The first code block of `text` that follows the line `after`, its lines
/// as written.
fn code_block_after<'a>(text: &'a str, after: &str) -> Vec<&'a str> {
    let at = text
        .find(after)
        .unwrap_or_else(|| panic!("{after:?} not found"));
    text[at..]
        .lines()
        .skip(1)
        .take_while(|l| {
            !l.trim_start().starts_with("```") && !l.trim_start().starts_with("/// ```")
        })
        .collect()
}

#[test]
fn the_documented_harness_test_is_the_compiled_doc_test() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let page = std::fs::read_to_string(root.join("docs/EMBEDDED.md")).expect("docs/EMBEDDED.md");
    let client = std::fs::read_to_string(root.join("src/harness/client.rs")).expect("client.rs");
    // docs/EMBEDDED.md's test function, its body unindented, without its
    // `Ok(())` (the doc test's is a hidden line).
    let body: Vec<&str> = code_block_after(&page, "fn the_key_passes_to_the_waiter_when")
        .into_iter()
        .map(|l| l.strip_prefix("    ").unwrap_or(l))
        .take_while(|l| *l != "Ok(())")
        .collect();
    // The doc test of `HarnessClient`, without its hidden lines.
    let doc: Vec<&str> = code_block_after(&client, "/// ```")
        .into_iter()
        .map(|l| {
            l.strip_prefix("/// ")
                .unwrap_or(l.trim_start_matches("///"))
        })
        .filter(|l| !l.starts_with("# "))
        .collect();
    assert!(body.len() > 10, "docs/EMBEDDED.md block found: {body:?}");
    assert_eq!(
        body, doc,
        "docs/EMBEDDED.md and HarnessClient's doc test differ"
    );
}

//! Workers in several languages contend for one key of one real ticketd at
//! once, each through its own language's client: Rust (`ticketd::client`,
//! on threads of this test), Python (`clients/python`), Go (`clients/go`,
//! built here with `go build`) and TypeScript (`clients/typescript`, built
//! beforehand with `npm ci && npm run build`, as `.ci/run` does).
//!
//! Every worker follows one contract, `WORKER ADDR KEY CYCLES
//! COUNTER_FILE`: each cycle acquires KEY (wait 30 s, lease 30 s), reads
//! the counter file as a decimal integer n (empty or missing: 0), writes
//! n+1 to it, prints "n token", and releases (it must answer released).
//! Exclusion held if the n values of all workers are exactly 0..total-1,
//! each once (no lost update); and sorted by n, the tokens strictly rise.

use ticketd_testkit::process as common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::thread;
use std::time::Duration;

use common::Ticketd;
use ticketd::client::{Acquire, Client, Release};

const KEY: &str = "languages";
const CYCLES: usize = 20;
const PER_LANGUAGE: usize = 2;

/// The worker programs: language, program, the arguments before `ADDR KEY
/// CYCLES COUNTER_FILE` (paths relative to the repository). Every one is
/// needed. `GO_WORKER` is the Go worker this test builds.
const WORKERS: &[(&str, &str, &[&str])] = &[
    (
        "python",
        "python3",
        &["clients/python/examples/contention_worker.py"],
    ),
    ("go", GO_WORKER, &[]),
    (
        "typescript",
        "node",
        &["clients/typescript/examples/contention-worker.mjs"],
    ),
];
const GO_WORKER: &str = "<go contention-worker>";

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// Whether `program` runs (`program --version`, or `go version`).
fn runs(program: &str) -> bool {
    let arg = if program == "go" {
        "version"
    } else {
        "--version"
    };
    Command::new(program)
        .arg(arg)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

/// Builds `clients/go/cmd/contention-worker` into `dir`.
fn build_go_worker(dir: &Path) -> PathBuf {
    assert!(
        runs("go"),
        "the Go toolchain (`go`) is needed for the Go worker: apt-get install golang-go"
    );
    let out = dir.join("go-contention-worker");
    let status = Command::new("go")
        .args(["build", "-o"])
        .arg(&out)
        .arg("./cmd/contention-worker")
        .current_dir(repo().join("clients/go"))
        .env("GOPROXY", "off")
        .status()
        .expect("run go build");
    assert!(status.success(), "go build of the Go worker failed");
    out
}

/// The command lines of the worker processes, `PER_LANGUAGE` per language.
fn worker_commands(dir: &Path) -> Vec<(String, PathBuf, Vec<PathBuf>)> {
    let mut out = Vec::new();
    for &(lang, program, args) in WORKERS {
        let args: Vec<PathBuf> = args.iter().map(|a| repo().join(a)).collect();
        if lang == "typescript" {
            assert!(
                repo().join("clients/typescript/dist/index.js").exists(),
                "the TypeScript worker needs the built client: \
                 cd clients/typescript && npm ci && npm run build"
            );
        }
        let program = if program == GO_WORKER {
            build_go_worker(dir)
        } else {
            assert!(runs(program), "`{program}` is needed for the {lang} worker");
            PathBuf::from(program)
        };
        for i in 0..PER_LANGUAGE {
            out.push((format!("{lang}-{i}"), program.clone(), args.clone()));
        }
    }
    out
}

/// The Rust worker: the same contract, on a thread, through its own client.
fn rust_worker(addr: String, counter: PathBuf) -> Vec<String> {
    let client = Client::connect(addr.as_str()).expect("client");
    let mut lines = Vec::with_capacity(CYCLES);
    for _ in 0..CYCLES {
        let ticket = match client.acquire(KEY, Duration::from_secs(30), Duration::from_secs(30)) {
            Ok(Acquire::Acquired(t)) => t,
            other => panic!("rust worker: not acquired: {other:?}"),
        };
        let text = std::fs::read_to_string(&counter).unwrap_or_default();
        let n: u64 = if text.trim().is_empty() {
            0
        } else {
            text.trim().parse().expect("counter file")
        };
        std::fs::write(&counter, (n + 1).to_string()).expect("write the counter");
        lines.push(format!("{n} {}", ticket.token()));
        assert_eq!(ticket.release().expect("release"), Release::Released);
    }
    lines
}

/// "n token" lines into pairs.
fn parse(who: &str, text: &str) -> Vec<(u64, u64)> {
    text.lines()
        .map(|l| {
            let mut f = l.split_whitespace().map(|x| x.parse::<u64>());
            match (f.next(), f.next(), f.next()) {
                (Some(Ok(n)), Some(Ok(t)), None) => (n, t),
                _ => panic!("{who}: bad line {l:?}"),
            }
        })
        .collect()
}

#[test]
fn workers_in_every_language_share_one_key_without_a_lost_update() {
    let server = Ticketd::start(&[]);
    let addr = server.addr().to_string();
    let dir = tempfile_dir();
    let counter = dir.join("counter");
    let commands = worker_commands(&dir);
    let children: Vec<_> = commands
        .iter()
        .map(|(who, program, args)| {
            let child = Command::new(program)
                .args(args)
                .args([addr.as_str(), KEY, &CYCLES.to_string()])
                .arg(&counter)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap_or_else(|e| panic!("{who}: cannot start {}: {e}", program.display()));
            (who.clone(), child)
        })
        .collect();
    let threads: Vec<_> = (0..PER_LANGUAGE)
        .map(|_| {
            let (addr, counter) = (addr.clone(), counter.clone());
            thread::spawn(move || rust_worker(addr, counter))
        })
        .collect();
    let mut grants = Vec::new();
    for (who, child) in children {
        let out = common::finish(child, Duration::from_secs(120));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success(),
            "{who} failed ({}): {stderr}",
            out.status
        );
        let lines = parse(&who, &String::from_utf8_lossy(&out.stdout));
        assert_eq!(lines.len(), CYCLES, "{who}: {stderr}");
        grants.extend(lines);
    }
    for (i, t) in threads.into_iter().enumerate() {
        let lines = t.join().expect("rust worker");
        grants.extend(parse(&format!("rust-{i}"), &lines.join("\n")));
    }
    let total = (commands.len() + PER_LANGUAGE) * CYCLES;
    assert_eq!(grants.len(), total);
    grants.sort_unstable();
    for (i, &(n, _)) in grants.iter().enumerate() {
        assert_eq!(
            n, i as u64,
            "the counter went wrong: an update was lost or repeated"
        );
    }
    for w in grants.windows(2) {
        assert!(w[0].1 < w[1].1, "token {} after {}", w[1].1, w[0].1);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A directory of this test's own under the system's temporary directory.
fn tempfile_dir() -> PathBuf {
    let d = std::env::temp_dir().join(format!("ticketd-languages-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("make a temporary directory");
    d
}

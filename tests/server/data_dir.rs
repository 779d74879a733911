//! The data directory as the real binary sees it: a damaged token mark
//! refuses to start (exit 1, a message naming the file and what to do), a
//! good one resumes above every token issued before, files are private
//! whatever the umask, a planted temporary-file symlink is not followed,
//! and a mark in the format before checksums still starts (and is
//! rewritten).

use ticketd_testkit::process as common;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use common::{run_ticketd, Reply, Ticketd};
use ticketd::token::{RANDOM_BITS, STEP};

fn temp_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("ticketd-datadir-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// Grants `key` (and releases it, so nothing is outstanding at the next
/// start) and returns the token.
fn grant(server: &Ticketd, key: &str) -> u64 {
    let mut c = server.connect();
    let token = c.acquire_reply(key, 1, 0, 30).token();
    assert!(matches!(
        c.release_reply(key, token),
        Reply::Released { .. }
    ));
    token
}

/// Starts a server on `dir`, grants once, stops it with SIGTERM; returns
/// the token.
fn run_once(dir: &Path) -> u64 {
    let mut server = Ticketd::start(&["--data-dir", dir.to_str().unwrap()]);
    let t = grant(&server, "k");
    assert_eq!(server.terminate().code(), Some(0), "{}", server.log());
    t
}

/// Starting on `dir` fails with exit status 1; returns stderr.
fn refused(dir: &Path) -> String {
    let out = run_ticketd(&[
        "--listen",
        "127.0.0.1:0",
        "--data-dir",
        dir.to_str().unwrap(),
    ]);
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(1), "should refuse to start: {err}");
    err
}

fn mode(p: &Path) -> u32 {
    std::fs::symlink_metadata(p).unwrap().permissions().mode() & 0o777
}

#[test]
fn a_new_directory_is_created_private_even_under_umask_000() {
    let base = temp_dir("umask");
    let dir = base.join("new/data");
    let mut server = Ticketd::start_raw(
        &["sh", "-c", "umask 000 && exec \"$0\" \"$@\""],
        &[
            "--listen",
            "127.0.0.1:0",
            "--data-dir",
            dir.to_str().unwrap(),
        ],
    );
    let t = grant(&server, "k");
    assert_eq!(
        t >> RANDOM_BITS,
        1,
        "{t}: a brand-new directory starts at step 1"
    );
    assert_eq!(server.terminate().code(), Some(0));
    assert_eq!(mode(&dir), 0o700, "the data directory");
    assert_eq!(mode(&base.join("new")), 0o700, "its parent, created too");
    for name in ["token-mark", "token-floor", "lease-bound", "lock"] {
        assert_eq!(mode(&dir.join(name)), 0o600, "{name}");
    }
    assert!(!dir.join("token-mark.tmp").exists());
    std::fs::remove_dir_all(&base).unwrap();
}

#[test]
fn every_damaged_mark_refuses_to_start_and_a_good_one_resumes_above_all_tokens() {
    let dir = temp_dir("damage");
    let first = run_once(&dir);
    let mark_path = dir.join("token-mark");
    let old_mark = std::fs::read(&mark_path).unwrap();
    let second = run_once(&dir);
    assert!(second > first);
    let good = std::fs::read(&mark_path).unwrap();
    let mark_name = mark_path.display().to_string();

    // Truncated to "20" (what a torn or hand-edited file can look like).
    std::fs::write(&mark_path, "20").unwrap();
    let err = refused(&dir);
    assert!(err.contains(&mark_name) && err.contains("short"), "{err}");
    assert!(err.contains("restore"), "says what to do: {err}");

    // Deleted.
    std::fs::remove_file(&mark_path).unwrap();
    let err = refused(&dir);
    assert!(err.contains(&mark_name) && err.contains("missing"), "{err}");

    // One byte of the value changed.
    let text = String::from_utf8(good.clone()).unwrap();
    let at = text.find("mark ").unwrap() + "mark ".len();
    let mut corrupt = good.clone();
    corrupt[at] = if corrupt[at] == b'1' { b'2' } else { b'1' };
    std::fs::write(&mark_path, &corrupt).unwrap();
    let err = refused(&dir);
    assert!(
        err.contains(&mark_name) && err.contains("checksum"),
        "{err}"
    );

    // A lower mark with a valid checksum (an old copy put back).
    std::fs::write(&mark_path, &old_mark).unwrap();
    let err = refused(&dir);
    assert!(err.contains(&mark_name) && err.contains("lower"), "{err}");

    // The directory's own record damaged.
    std::fs::write(&mark_path, &good).unwrap();
    let floor_path = dir.join("token-floor");
    let floor = std::fs::read(&floor_path).unwrap();
    std::fs::write(&floor_path, &floor[..floor.len() - 3]).unwrap();
    let err = refused(&dir);
    assert!(err.contains(&floor_path.display().to_string()), "{err}");
    std::fs::write(&floor_path, &floor).unwrap();

    // Nothing above was changed by a refused start: the good mark starts,
    // above every token issued before.
    assert_eq!(std::fs::read(&mark_path).unwrap(), good);
    let third = run_once(&dir);
    assert!(third > second, "{third} after {second}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_planted_temporary_file_symlink_is_not_followed() {
    let base = temp_dir("symlink");
    let dir = base.join("data");
    let first = run_once(&dir);
    let victim = base.join("victim");
    std::fs::write(&victim, "precious").unwrap();
    std::os::unix::fs::symlink(&victim, dir.join("token-mark.tmp")).unwrap();
    let second = run_once(&dir);
    assert!(second > first);
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious");
    assert!(std::fs::symlink_metadata(dir.join("token-mark"))
        .unwrap()
        .is_file());
    std::fs::remove_dir_all(&base).unwrap();
}

#[test]
fn a_mark_in_the_format_before_checksums_still_starts_and_is_rewritten() {
    let dir = temp_dir("v1");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("token-mark"),
        "ticketd token high-water mark v1\n2097152\n",
    )
    .unwrap();
    let mut server = Ticketd::start(&["--data-dir", dir.to_str().unwrap()]);
    // The first sequence step above the old mark, random low bits.
    let t = grant(&server, "k");
    assert_eq!(t >> RANDOM_BITS, 2_097_152 / STEP + 1, "{t}");
    assert_eq!(server.terminate().code(), Some(0));
    let text = std::fs::read_to_string(dir.join("token-mark")).unwrap();
    assert!(
        text.contains("v2") && text.contains("check length="),
        "{text}"
    );
    // From now on the directory is checked like any other.
    std::fs::remove_file(dir.join("token-mark")).unwrap();
    refused(&dir);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A cluster node's data directory follows the same rules: created 0700
/// with a 0600 `wal` under umask 000.
#[cfg(feature = "cluster")]
#[test]
fn a_cluster_node_creates_its_data_dir_private_under_umask_000() {
    let base = temp_dir("cluster-umask");
    let dir = base.join("node1");
    let peers = format!(
        "1=127.0.0.1:{},2=127.0.0.1:{},3=127.0.0.1:{}",
        common::free_port(),
        common::free_port(),
        common::free_port()
    );
    let dir_s = dir.to_str().unwrap();
    let node = Ticketd::start_raw(
        &["sh", "-c", "umask 000 && exec \"$0\" \"$@\""],
        &[
            "--cluster",
            "--id",
            "1",
            "--peers",
            &peers,
            "--data-dir",
            dir_s,
            "--listen",
            "127.0.0.1:0",
        ],
    );
    assert_eq!(mode(&base), 0o700, "the parent the node created");
    assert_eq!(mode(&dir), 0o700, "the data directory");
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        assert_eq!(mode(&path), 0o600, "{}", path.display());
    }
    assert!(dir.join("wal").exists());
    drop(node);
    std::fs::remove_dir_all(&base).unwrap();
}

//! The data directory as the real binary sees it: a damaged token mark
//! refuses to start (exit 1, a message naming the file and what to do), a
//! good one resumes above every token issued before, files are private
//! whatever the umask, a planted temporary-file symlink is not followed,
//! and a mark in the format before checksums still starts (and is
//! rewritten). A used directory without mark and floor, one others may
//! write to (without `--insecure`), and a FIFO or symlink in place of a
//! file are refused at once; in cluster mode too.

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

/// Runs `ticketd ARGS` to its end, killed (and the test failed) if it has
/// not exited after 5 s: a start that waits on a FIFO would never end.
fn run_bounded(args: &[&str]) -> (std::process::Output, std::time::Duration) {
    let start = std::time::Instant::now();
    let child = common::bin_command(common::ticketd_bin())
        .args(args)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn ticketd");
    let out = common::finish(child, std::time::Duration::from_secs(5));
    (out, start.elapsed())
}

fn mkfifo(path: &Path) {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).unwrap();
    // SAFETY: a NUL-terminated path that outlives the call.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0, "mkfifo");
}

/// The names in `dir`, sorted.
fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

/// Deleting both the mark and the floor of a used directory would restart
/// tokens at the first step: the start is refused, naming the missing
/// files and those that show the directory was used.
#[test]
fn a_used_directory_without_mark_and_floor_refuses_to_start() {
    let dir = temp_dir("no-mark-no-floor");
    let first = run_once(&dir);
    assert!(first >> RANDOM_BITS >= 1);
    std::fs::remove_file(dir.join("token-mark")).unwrap();
    std::fs::remove_file(dir.join("token-floor")).unwrap();
    let before = names(&dir);
    let err = refused(&dir);
    for name in ["token-mark", "token-floor"] {
        let path = dir.join(name).display().to_string();
        assert!(err.contains(&format!("{path} ")), "{name}: {err}");
    }
    assert!(
        err.contains("missing") && err.contains("used (lock, lease-bound)"),
        "{err}"
    );
    assert!(err.contains("restore"), "says what to do: {err}");
    assert_eq!(names(&dir), before, "a refused start writes nothing");
    // Only the lease bound left (no lock): refused just the same.
    std::fs::remove_file(dir.join("lock")).unwrap();
    let err = refused(&dir);
    assert!(err.contains("used (lease-bound)"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();

    // A new directory holding only files ticketd never writes starts.
    let dir = temp_dir("foreign-files");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("README"), "ticketd data\n").unwrap();
    let t = run_once(&dir);
    assert_eq!(t >> RANDOM_BITS, 1, "{t}: starts at the first step");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A data directory its group or other users may write to is refused (they
/// could remove the mark); `--insecure` uses it, with a warning.
#[test]
fn a_writable_data_directory_is_refused_unless_insecure() {
    let dir = temp_dir("mode-0777");
    std::fs::create_dir_all(&dir).unwrap();
    for bad in [0o777, 0o770, 0o757] {
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(bad)).unwrap();
        let err = refused(&dir);
        assert!(
            err.contains(&dir.display().to_string())
                && err.contains(&format!("(mode {bad:04o})"))
                && err.contains("--insecure"),
            "{err}"
        );
        assert_eq!(mode(&dir), bad, "left as it was");
        assert!(names(&dir).is_empty(), "nothing written: {:?}", names(&dir));
    }
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
    let dir_s = dir.to_str().unwrap();
    let mut server = Ticketd::start(&["--data-dir", dir_s, "--insecure"]);
    assert!(
        server.log().contains("WARN") && server.log().contains("(mode 0777)"),
        "{}",
        server.log()
    );
    grant(&server, "k");
    assert_eq!(server.terminate().code(), Some(0));
    // Made private, it starts without the flag.
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o750)).unwrap();
    let mut server = Ticketd::start(&["--data-dir", dir_s]);
    assert!(!server.log().contains("WARN"), "{}", server.log());
    assert_eq!(server.terminate().code(), Some(0));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A FIFO at `lease-bound` or `token-mark` (or a symlink to a device) is
/// refused at once with a message naming it, never opened: the start does
/// not hang waiting for a writer, and reads nothing from a device.
#[test]
fn a_fifo_or_device_in_place_of_a_data_file_is_refused_at_once() {
    let dir = temp_dir("fifo");
    run_once(&dir);
    let dir_s = dir.to_str().unwrap();
    let args = ["--listen", "127.0.0.1:0", "--data-dir", dir_s];
    for name in ["lease-bound", "token-mark", "token-floor", "lock"] {
        let path = dir.join(name);
        let saved = std::fs::read(&path).unwrap();
        for (what, plant) in [
            ("a FIFO", &(|p: &Path| mkfifo(p)) as &dyn Fn(&Path)),
            ("a symbolic link", &|p: &Path| {
                std::os::unix::fs::symlink("/dev/zero", p).unwrap();
            }),
        ] {
            std::fs::remove_file(&path).unwrap();
            plant(&path);
            let (out, took) = run_bounded(&args);
            let err = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(1), "{name}: {err}");
            assert!(
                err.contains(&format!("{} is {what}", path.display()))
                    && err.contains("only regular files"),
                "{name}: {err}"
            );
            println!("{name} as {what}: refused in {took:?}");
        }
        std::fs::remove_file(&path).unwrap();
        std::fs::write(&path, saved).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
    }
    // Put back, the directory starts above every token issued before.
    run_once(&dir);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A cluster node locks its data directory (`lock`, created after `wal`);
/// a directory whose lock shows it was used but whose WAL is gone is
/// refused (a one-voter cluster would otherwise issue tokens from index 1
/// again), and so are a writable directory and a single-mode one.
#[cfg(feature = "cluster")]
#[test]
fn a_cluster_node_refuses_a_used_directory_without_its_wal() {
    let base = temp_dir("cluster-used");
    let dir = base.join("node1");
    let peers = format!("1=127.0.0.1:{}", common::free_port());
    let dir_s = dir.to_str().unwrap();
    let args = [
        "--cluster",
        "--id",
        "1",
        "--peers",
        &peers,
        "--data-dir",
        dir_s,
        "--listen",
        "127.0.0.1:0",
    ];
    let mut node = Ticketd::start_raw(&[], &args);
    assert!(dir.join("lock").exists() && dir.join("wal").exists());
    // A second node on the same directory: refused while the first runs.
    let (out, _) = run_bounded(&args);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("in use by another ticketd"), "{err}");
    assert_eq!(node.terminate().code(), Some(0), "{}", node.log());
    // A FIFO in place of the WAL: refused at once, never read.
    std::fs::remove_file(dir.join("wal")).unwrap();
    mkfifo(&dir.join("wal"));
    let (out, _) = run_bounded(&args);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("wal is a FIFO"), "{err}");
    std::fs::remove_file(dir.join("wal")).unwrap();
    // The WAL gone, its lock left: refused.
    let (out, _) = run_bounded(&args);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains(&format!("{} is missing", dir.join("wal").display()))
            && err.contains(&dir.join("lock").display().to_string()),
        "{err}"
    );
    assert!(!dir.join("wal").exists(), "a refused start writes nothing");
    // A single-mode directory is not a node's.
    let single = base.join("single");
    run_once(&single);
    let mut single_args = args;
    single_args[6] = single.to_str().unwrap();
    let (out, _) = run_bounded(&single_args);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("single-mode"), "{err}");
    // A writable directory: refused, then used with --insecure.
    std::fs::remove_dir_all(&dir).unwrap();
    std::fs::create_dir(&dir).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
    let (out, _) = run_bounded(&args);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("(mode 0777)") && err.contains("--insecure"),
        "{err}"
    );
    let mut insecure = args.to_vec();
    insecure.push("--insecure");
    let mut node = Ticketd::start_raw(&[], &insecure);
    assert!(node.log().contains("(mode 0777)"), "{}", node.log());
    assert_eq!(node.terminate().code(), Some(0), "{}", node.log());
    std::fs::remove_dir_all(&base).unwrap();
}

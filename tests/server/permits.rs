//! Protocol 1.2 against the real single-mode server (PROTOCOL §6):
//! semaphores and read/write locks over raw frames, through the Rust
//! client, and with `ticket acquire --permits` and `ticket run --permits`.

use std::process::{Command, Output, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use ticketd::client::{Acquire, Client};
use ticketd::proto::{Mode, Places};
use ticketd_testkit::process::{self as common, Reply, Ticketd};

const S: Duration = Duration::from_secs(1);

fn permit_frame(key: &str, owner: u64, limit: u16, mode: Mode, wait_s: u8) -> Vec<u8> {
    common::permit_frame(key, owner, Places { limit, mode }, wait_s, 30)
}

fn ticket(server: &Ticketd, args: &[&str]) -> Command {
    let mut c = common::bin_command(env!("CARGO_BIN_EXE_ticket"));
    let (sub, rest) = args.split_first().expect("a subcommand");
    c.arg(sub)
        .args(["--server", &server.addr().to_string()])
        .args(rest);
    c
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn a_semaphore_over_the_wire_grants_its_limit_answers_l_and_hands_places_on() {
    let server = Ticketd::start(&[]);
    let mut a = common::Client::connect(server.addr());
    let mut b = common::Client::connect(server.addr());
    a.send(&permit_frame("pool", 1, 2, Mode::Shared, 0));
    a.send(&permit_frame("pool", 2, 2, Mode::Shared, 0));
    let (t1, t2) = (a.recv().token(), a.recv().token());
    assert!(t2 > t1, "each permit its own, greater token");
    // Full: wait 0 is T, another limit is L with the key's, an A is B.
    a.send(&permit_frame("pool", 3, 2, Mode::Shared, 0));
    a.send(&permit_frame("pool", 4, 5, Mode::Shared, 9));
    a.acquire("pool", 5, 9, 30);
    let replies = a.recv_n(3);
    let key = || "pool".to_owned();
    assert_eq!(
        replies,
        [
            Reply::Timeout {
                owner: 3,
                key: key()
            },
            Reply::LimitMismatch {
                owner: 4,
                limit: 2,
                key: key()
            },
            Reply::Busy {
                owner: 5,
                key: key()
            },
        ]
    );
    // A queued permit gets the place a release frees.
    b.send(&permit_frame("pool", 6, 2, Mode::Shared, 10));
    assert!(b.try_recv(Duration::from_millis(300)).is_err(), "queued");
    assert_eq!(
        a.release_reply("pool", t1),
        Reply::Released {
            token: t1,
            key: key()
        }
    );
    let t3 = b.recv().token();
    assert!(t3 > t2);
    // A limit of 0 is malformed: the connection is closed.
    let mut bad = permit_frame("pool", 7, 2, Mode::Shared, 0);
    bad[11] = 0;
    bad[12] = 0;
    let mut c = common::Client::connect(server.addr());
    c.send(&bad);
    assert!(c.closed_within(5 * S));
}

#[test]
fn a_queued_writer_holds_back_later_readers_through_the_client() {
    let server = Ticketd::start(&[]);
    let client = Client::connect(server.addr().to_string()).unwrap();
    let Acquire::Acquired(reader) = client.acquire_shared("catalog", S, 30 * S).unwrap() else {
        panic!("first reader")
    };
    let Acquire::Acquired(second) = client.acquire_shared("catalog", S, 30 * S).unwrap() else {
        panic!("second reader")
    };
    let writer_client = client.clone();
    let writer = thread::spawn(move || writer_client.acquire_exclusive("catalog", 10 * S, 30 * S));
    thread::sleep(Duration::from_millis(300));
    let late = client
        .acquire_shared("catalog", Duration::ZERO, 30 * S)
        .unwrap();
    assert!(
        matches!(late, Acquire::Timeout),
        "a writer waits first: {late:?}"
    );
    let started = Instant::now();
    reader.release().unwrap();
    second.release().unwrap();
    let Acquire::Acquired(w) = writer.join().unwrap().unwrap() else {
        panic!("the writer")
    };
    assert!(started.elapsed() < 5 * S);
    assert!(w.token() > 0);
    let mutex = client.acquire("catalog", Duration::ZERO, 30 * S).unwrap();
    assert!(matches!(mutex, Acquire::Busy), "{mutex:?}");
    let other = client
        .acquire_permit("catalog", 3, Duration::ZERO, 30 * S)
        .unwrap();
    assert!(matches!(other, Acquire::LimitMismatch(65_535)), "{other:?}");
    w.release().unwrap();
}

#[test]
fn ticket_run_with_permits_lets_two_commands_in_and_refuses_a_third() {
    let server = Ticketd::start(&[]);
    let hold = |name: &str| {
        ticket(
            &server,
            &["run", "fleet", "--permits", "2", "--wait", "0", "--"],
        )
        .args(["sh", "-c", &format!("echo {name} $TICKET_TOKEN; sleep 3")])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("ticket run")
    };
    let first = hold("one");
    let second = hold("two");
    thread::sleep(Duration::from_millis(1_000));
    let third = ticket(
        &server,
        &["acquire", "fleet", "--permits", "2", "--wait", "0"],
    )
    .output()
    .unwrap();
    assert_eq!(third.status.code(), Some(120), "{}", stderr(&third));
    let other = ticket(
        &server,
        &["acquire", "fleet", "--permits", "3", "--wait", "0"],
    )
    .output()
    .unwrap();
    assert_eq!(other.status.code(), Some(121), "{}", stderr(&other));
    assert!(
        stderr(&other).contains("a limit of 2 (a semaphore)"),
        "{}",
        stderr(&other)
    );
    let mut tokens = Vec::new();
    for child in [first, second] {
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success(), "{}", stderr(&out));
        let line = String::from_utf8_lossy(&out.stdout).into_owned();
        tokens.push(
            line.split_whitespace()
                .nth(1)
                .unwrap()
                .parse::<u64>()
                .unwrap(),
        );
    }
    assert_ne!(tokens[0], tokens[1], "each holder its own token");
    // Both released at exit: the key takes two again.
    let again = ticket(
        &server,
        &["acquire", "fleet", "--permits", "2", "--wait", "0"],
    )
    .output()
    .unwrap();
    assert_eq!(again.status.code(), Some(0), "{}", stderr(&again));
}

#[test]
fn the_admin_port_and_ticket_status_show_holders_and_waiters_by_mode() {
    let server = Ticketd::start(&["--admin-listen", "127.0.0.1:0"]);
    let admin = server.admin_addr().expect("admin start-up line");
    let mut a = common::Client::connect(server.addr());
    a.send(&permit_frame("rw", 1, u16::MAX, Mode::Shared, 0));
    a.send(&permit_frame("rw", 2, u16::MAX, Mode::Shared, 0));
    let (t1, t2) = (a.recv().token(), a.recv().token());
    a.send(&permit_frame("rw", 3, u16::MAX, Mode::Exclusive, 30));
    a.send(&permit_frame("rw", 4, u16::MAX, Mode::Shared, 30));
    a.acquire("m", 5, 0, 30);
    assert!(a.recv().token() > 0);
    let (code, body) = common::http(admin, "GET", "/v1/locks/rw").expect("an answer");
    assert_eq!(code, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["limit"], 65_535);
    let holders = v["holders"].as_array().expect("holders");
    let seqs: Vec<u64> = holders
        .iter()
        .map(|h| h["sequence"].as_u64().unwrap())
        .collect();
    assert_eq!(seqs, [t1 >> 16, t2 >> 16], "oldest first");
    assert!(holders
        .iter()
        .all(|h| h["mode"] == "shared" && h["token"].is_null()));
    assert_eq!(
        (&v["waiters"], &v["waiters_shared"], &v["waiters_exclusive"]),
        (&2.into(), &1.into(), &1.into())
    );
    // The listing shows both kinds of key, in key order.
    let (_, list) = common::http(admin, "GET", "/v1/locks").expect("an answer");
    let list: serde_json::Value = serde_json::from_str(&list).unwrap();
    let keys: Vec<&str> = list["locks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["key"].as_str().unwrap())
        .collect();
    assert_eq!(keys, ["m", "rw"]);
    let status = common::bin_command(env!("CARGO_BIN_EXE_ticket"))
        .args(["status", "rw", "--admin", &admin.to_string()])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&status.stdout);
    assert!(status.status.success(), "{}", stderr(&status));
    let want = format!("2/65535: #{},#{}", t1 >> 16, t2 >> 16);
    assert!(text.contains(&want), "{text}");
    assert!(text.contains("2 (1 shared, 1 exclusive)"), "{text}");
}

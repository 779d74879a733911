//! Unit tests of the outbox and of the engine's grants, queues and leases.

use super::conns::ConnSlot;
use super::waiters::{Waiter, WAITER_ID_LIMIT};
use super::*;
use crate::proto::{encode_reply, Reply};

/// Seven replies to connections 1 and 2 in three runs, every kind
/// among them: a grant and an extension to withhold, wrong-token answers.
fn mixed_replies() -> [(ConnId, Reply<'static>, u8); 7] {
    [
        (
            1,
            Reply::Acquired {
                token: 7,
                owner: 0x0A0B,
                key: "db",
            },
            30,
        ),
        (
            1,
            Reply::Released {
                token: 7,
                key: "db",
            },
            0,
        ),
        (
            2,
            Reply::Timeout {
                owner: 3, key: "é"
            },
            0,
        ),
        (2, Reply::Extended { token: 9, key: "k" }, 5),
        (2, Reply::Busy { owner: 4, key: "k" }, 0),
        (1, Reply::NotExtended { token: 1, key: "x" }, 0),
        (1, Reply::NotReleased { token: 2, key: "x" }, 0),
    ]
}

/// The codec's bytes of `rs`, one frame after another.
fn wire(rs: &[(ConnId, Reply<'_>, u8)]) -> Vec<u8> {
    let mut v = Vec::new();
    for (_, r, _) in rs {
        encode_reply(r, &mut v);
    }
    v
}

/// The outbox's frames, a run per item.
fn runs(out: &Outbox) -> Vec<(ConnId, Vec<u8>)> {
    out.frames().map(|(c, f)| (c, f.to_vec())).collect()
}

/// The server copies `frames()` to the sockets and services read
/// `iter()`: both must tell the same replies, in order, the bytes being
/// the codec's, a run per connection, and nothing of a withheld grant.
#[test]
fn outbox_frames_are_the_encoded_replies_in_runs_per_connection() {
    let replies = mixed_replies();
    let mut out = Outbox::new();
    for &(conn, reply, lease_s) in &replies {
        out.push(conn, reply, lease_s);
    }
    let read: Vec<_> = out.iter().map(|a| (a.conn, a.reply, a.lease_s)).collect();
    assert_eq!(read, replies);
    assert_eq!(
        runs(&out),
        vec![
            (1, wire(&replies[0..2])),
            (2, wire(&replies[2..5])),
            (1, wire(&replies[5..7])),
        ]
    );
    // Withholding the grant and the extension splits their runs.
    assert_eq!(out.retain_leases(|_| false), 2);
    assert_eq!(
        runs(&out),
        vec![
            (1, wire(&replies[1..2])),
            (2, wire(&replies[2..3])),
            (2, wire(&replies[4..5])),
            (1, wire(&replies[5..7])),
        ]
    );
    assert_eq!(out.iter().count(), 5);
    // Counted at push, less what was withheld; wrong-token answers in
    // order.
    let mut counts = [0; 7];
    out.tally(&mut counts);
    assert_eq!(counts, [0, 1, 1, 1, 1, 0, 1]);
    assert_eq!(out.wrong_token_answers().collect::<Vec<_>>(), [1, 1]);
    out.clear();
    assert!(out.is_empty() && out.frames().next().is_none());
    out.tally(&mut counts);
    assert_eq!(counts, [0, 1, 1, 1, 1, 0, 1], "nothing held adds nothing");
    assert_eq!(out.wrong_token_answers().count(), 0);
    out.push(3, Reply::NotReleased { token: 1, key: "a" }, 0);
    out.push(4, Reply::Released { token: 1, key: "a" }, 0);
    out.push(5, Reply::NotExtended { token: 1, key: "a" }, 0);
    assert_eq!(out.wrong_token_answers().collect::<Vec<_>>(), [3, 5]);
    out.tally(&mut counts);
    assert_eq!(counts, [0, 1, 1, 2, 2, 0, 2]);
    // An N or X to token 0 guessed at nothing: answered and counted,
    // but not a wrong-token answer.
    out.clear();
    out.push(6, Reply::NotReleased { token: 0, key: "a" }, 0);
    out.push(7, Reply::NotExtended { token: 0, key: "a" }, 0);
    out.push(8, Reply::NotReleased { token: 2, key: "a" }, 0);
    assert_eq!(out.wrong_token_answers().collect::<Vec<_>>(), [8]);
    assert_eq!(out.iter().count(), 3);
}

/// Replies to the connection whose write buffer is lent are encoded at
/// its end, byte for byte what `frames()` would have carried, in order
/// after what the buffer held; replies to others stay in the outbox.
/// They are counted, their wrong-token answers listed, and a withheld
/// grant or extension among them is listed as the range to cut out.
/// Long because it follows one lent buffer from its loan to the turn's end.
#[test]
fn a_lent_write_buffer_gets_its_replies_encoded_and_withheld_ranges_listed() {
    let mine = [
        (
            Reply::Acquired {
                token: 7,
                owner: 1,
                key: "db",
            },
            30,
        ),
        (
            Reply::Released {
                token: 7,
                key: "db",
            },
            0,
        ),
        (Reply::Extended { token: 9, key: "k" }, 5),
        (Reply::NotReleased { token: 2, key: "x" }, 0),
        (Reply::Busy { owner: 4, key: "k" }, 0),
    ];
    let other = Reply::Acquired {
        token: 11,
        owner: 2,
        key: "q",
    };
    let mut routed = Outbox::new();
    let mut out = Outbox::new();
    assert!(out.may_lend(1));
    out.begin_direct(1, b"old".to_vec());
    assert!(!out.may_lend(2), "one buffer at a time");
    for (i, &(reply, lease_s)) in mine.iter().enumerate() {
        out.push(1, reply, lease_s);
        routed.push(1, reply, lease_s);
        if i == 1 {
            out.push(2, other, 10);
        }
    }
    let buf = out.end_direct();
    let want: Vec<u8> = routed.frames().flat_map(|(_, f)| f.to_vec()).collect();
    assert_eq!(buf[..3], *b"old");
    assert_eq!(buf[3..], want[..]);
    // Only the reply to connection 2 is held as a message.
    assert_eq!(out.len(), 1);
    assert_eq!(runs(&out), vec![(2, wire(&[(2, other, 10)]))]);
    assert!(!out.may_lend(2), "a reply to 2 is held: it goes first");
    assert!(out.may_lend(1));
    let mut counts = [0; 7];
    out.tally(&mut counts);
    assert_eq!(counts, [2, 0, 1, 1, 1, 1, 0]);
    assert_eq!(out.wrong_token_answers().collect::<Vec<_>>(), [1]);
    assert_eq!(out.direct_lent(), [(1, 3)]);
    // Withholding leases over 10 s: the 30 s grant in the buffer goes,
    // the 5 s extension and the 10 s grant to connection 2 stay.
    assert_eq!(out.retain_leases(|lease_s| lease_s <= 10), 1);
    let mut first = Vec::new();
    encode_reply(&mine[0].0, &mut first);
    assert_eq!(out.direct_withdrawn(), [(1, 3, 3 + first.len())]);
    let mut counts = [0; 7];
    out.tally(&mut counts);
    assert_eq!(counts, [1, 0, 1, 1, 1, 1, 0]);
    assert_eq!(
        out.retain_leases(|_| false),
        2,
        "the extension and the grant to 2"
    );
    assert_eq!(out.direct_withdrawn().len(), 2);
    out.clear();
    assert!(out.direct_lent().is_empty() && out.direct_withdrawn().is_empty());
    assert_eq!(out.wrong_token_answers().count(), 0);
    // Not lent: replies are held as before.
    out.push(1, mine[0].0, 30);
    assert_eq!(out.len(), 1);
    assert_eq!(out.direct_len(), 0);
}

#[test]
fn unmarked_direct_grants_keep_their_bytes_counts_and_wrong_token_marks() {
    let replies = [
        (
            Reply::Acquired {
                token: 7,
                owner: 1,
                key: "db",
            },
            30,
        ),
        (
            Reply::Extended {
                token: 7,
                key: "db",
            },
            5,
        ),
        (Reply::NotReleased { token: 2, key: "x" }, 0),
        (Reply::NotExtended { token: 3, key: "y" }, 0),
        (
            Reply::Released {
                token: 7,
                key: "db",
            },
            0,
        ),
    ];
    let mut routed = Outbox::new();
    for (marked, want_marks) in [(true, 4), (false, 2)] {
        let mut out = Outbox::new();
        out.set_direct_grant_marks(marked);
        out.begin_direct(1, Vec::new());
        for &(reply, lease_s) in &replies {
            out.push(1, reply, lease_s);
            if marked {
                routed.push(1, reply, lease_s);
            }
        }
        let buf = out.end_direct();
        let want: Vec<u8> = routed.frames().flat_map(|(_, f)| f.to_vec()).collect();
        assert_eq!(buf, want, "marked: {marked}");
        assert_eq!(out.direct_mark_count(), want_marks, "marked: {marked}");
        let mut counts = [0; 7];
        out.tally(&mut counts);
        assert_eq!(counts, [1, 0, 0, 1, 1, 1, 1]);
        assert_eq!(out.wrong_token_answers().collect::<Vec<_>>(), [1, 1]);
        out.clear();
        // Nothing lent since the clear: held grants are withheld as
        // ever, whatever the setting.
        out.push(2, replies[0].0, 30);
        assert_eq!(out.retain_leases(|_| false), 1);
    }
}

#[test]
#[should_panic(expected = "not marked")]
fn retain_leases_refuses_a_turn_whose_lent_grants_are_not_marked() {
    let mut out = Outbox::new();
    out.set_direct_grant_marks(false);
    out.begin_direct(1, Vec::new());
    out.push(
        1,
        Reply::Acquired {
            token: 7,
            owner: 1,
            key: "db",
        },
        30,
    );
    let _ = out.end_direct();
    out.retain_leases(|_| false);
}

/// What happened reads back as typed events, each carrying the tag of
/// the request it answers: a grant's tag moves from waiter to holder.
/// Long because it walks one scenario, step by step, with its events.
#[test]
fn events_tell_how_each_grant_came_and_which_lease_ran_out() {
    let mut e: Engine<u32> = Engine::replicated_tagged(EngineLimits::default(), 1);
    let mut out = Outbox::default();
    let now = Millis::ZERO;
    e.acquire_tagged(now, 1, acq("k", 10, 0, 5), 100, &mut out);
    e.acquire_tagged(now, 2, acq("k", 20, 9, 6), 200, &mut out);
    e.acquire_tagged(now, 3, acq("k", 30, 0, 5), 300, &mut out);
    assert!(e.release(now, 1, 1, "k", &mut out));
    assert_eq!(e.grant("k"), Some((2, &200)));
    assert!(e.expire(now, "k", 2, &mut out));
    let got: Vec<Event<'_, u32>> = out.events().collect();
    assert_eq!(
        got,
        vec![
            Event::Granted {
                conn: 1,
                key: "k",
                token: 1,
                owner: 10,
                lease_s: 5,
                how: Grant::Fresh,
                tag: 100
            },
            Event::TimedOut {
                conn: 3,
                key: "k",
                owner: 30,
                tag: 300
            },
            Event::Released {
                conn: 1,
                key: "k",
                token: 1
            },
            Event::Granted {
                conn: 2,
                key: "k",
                token: 2,
                owner: 20,
                lease_s: 6,
                how: Grant::Handover,
                tag: 200
            },
            Event::Expired { key: "k", token: 2 },
        ]
    );
    // The expiry is no reply: the wire carries the four others.
    assert_eq!(out.iter().count(), 4);
    let mut counts = [0; 7];
    out.tally(&mut counts);
    assert_eq!(counts, [2, 1, 0, 1, 0, 0, 0]);
    // Single mode: a lazy takeover reports the lease that ended first.
    let mut e = Engine::new(EngineLimits::default(), 1);
    let mut out = Outbox::new();
    e.acquire(Millis(0), 1, acq("j", 1, 0, 1), &mut out);
    out.clear();
    e.acquire(Millis(5_000), 2, acq("j", 2, 0, 1), &mut out);
    let how: Vec<_> = out
        .events()
        .map(|ev| match ev {
            Event::Granted { how, token, .. } => format!("{how:?} {token}"),
            other => format!("{other:?}"),
        })
        .collect();
    assert_eq!(how, ["Expired { key: \"j\", token: 1 }", "Takeover 2"]);
    let frames: Vec<u8> = out.frames().flat_map(|(_, f)| f.to_vec()).collect();
    let mut wire = Vec::new();
    encode_reply(
        &Reply::Acquired {
            token: 2,
            owner: 2,
            key: "j",
        },
        &mut wire,
    );
    assert_eq!(frames, wire);
}

fn acq(key: &str, owner: u64, wait_s: u8, lease_s: u8) -> Acquire<'_> {
    Acquire {
        key,
        owner,
        wait_s,
        lease_s,
    }
}

fn replies(out: &mut Outbox) -> Vec<(ConnId, String)> {
    let v = out
        .iter()
        .map(|a| (a.conn, format!("{:?}", a.reply)))
        .collect();
    out.clear();
    v
}

#[test]
fn release_hands_over_fifo_and_expiry_hands_over_on_tick() {
    let mut e = Engine::new(EngineLimits::default(), 1);
    let mut out = Outbox::new();
    let t0 = Millis(1000);
    assert_eq!(
        e.acquire(t0, 1, acq("k", 10, 0, 5), &mut out),
        AcquireOutcome::Granted(1)
    );
    assert!(matches!(
        e.acquire(t0, 2, acq("k", 20, 9, 3), &mut out),
        AcquireOutcome::Queued(_)
    ));
    assert!(matches!(
        e.acquire(t0, 3, acq("k", 30, 60, 3), &mut out),
        AcquireOutcome::Queued(_)
    ));
    e.check_invariants();
    replies(&mut out);
    assert!(e.release(t0, 1, 1, "k", &mut out));
    let r = replies(&mut out);
    assert_eq!(r.len(), 2);
    assert_eq!(r[1].0, 2, "head waiter gets the key");
    e.check_invariants();
    // owner 20 holds with a 3 s lease from t0, over once t0 + 3 s is
    // past; owner 30 waits until t0 + 60 s.
    let lease_over = t0.add_secs(3).add_ms(1);
    assert_eq!(e.next_deadline(), Some(lease_over));
    e.tick(t0.add_secs(3), &mut out);
    assert!(out.is_empty(), "not yet past the expiry");
    e.tick(lease_over, &mut out);
    let r = replies(&mut out);
    assert_eq!(
        r,
        vec![(
            3,
            "Acquired { token: 3, owner: 30, key: \"k\" }".to_string()
        )]
    );
    e.check_invariants();
}

/// The memory figures of the module doc rest on these sizes.
#[test]
fn slots_are_32_bytes_and_waiters_32() {
    assert_eq!(std::mem::size_of::<Slot>(), 32);
    assert_eq!(std::mem::size_of::<Waiter>(), 32);
    assert_eq!(std::mem::size_of::<ConnSlot>(), 16);
    let w = Waiter {
        owner: 1,
        wait_deadline: Millis(3),
        id_lease: (WAITER_ID_LIMIT - 1) << 16 | 2 << 8 | 255,
        conn: 2,
        slot: 4,
        tag: (),
    };
    assert_eq!((w.id(), w.lease_s()), (WAITER_ID_LIMIT - 1, 255));
    let w = Waiter {
        wait_deadline: Millis(5_000),
        ..w
    };
    assert_eq!(w.queued_at(), Millis(3_000));
}

/// Waiter ids share a word with the wait and lease, so they wrap below 2^48,
/// skipping 0, and still name the right waiter.
#[test]
fn waiter_ids_wrap_below_the_lease_bits() {
    let mut e = Engine::replicated(EngineLimits::default(), 1);
    let mut out = Outbox::new();
    e.next_waiter = WAITER_ID_LIMIT - 1;
    e.acquire(Millis(0), 1, acq("k", 1, 0, 5), &mut out);
    let a = e.acquire(Millis(0), 2, acq("k", 2, 9, 7), &mut out);
    let b = e.acquire(Millis(0), 3, acq("k", 3, 9, 8), &mut out);
    assert_eq!(a, AcquireOutcome::Queued(WAITER_ID_LIMIT - 1));
    assert_eq!(b, AcquireOutcome::Queued(1));
    out.clear();
    assert!(e.wait_timeout(Millis(0), "k", 1, &mut out));
    assert_eq!(e.queued_owners("k"), vec![2]);
    assert!(e.expire(Millis(0), "k", 1, &mut out));
    let r = replies(&mut out);
    assert_eq!(
        r[1],
        (2, "Acquired { token: 2, owner: 2, key: \"k\" }".to_string())
    );
    assert_eq!(out.len(), 0);
    e.check_invariants();
}

#[test]
fn a_waiter_whose_wait_ran_out_is_never_granted() {
    let mut e = Engine::new(EngineLimits::default(), 7);
    let mut out = Outbox::new();
    e.acquire(Millis(0), 1, acq("k", 1, 0, 30), &mut out);
    e.acquire(Millis(0), 2, acq("k", 2, 1, 30), &mut out);
    out.clear();
    // The release comes after the wait ran out but before any tick.
    assert!(e.release(Millis(1000), 1, 7, "k", &mut out));
    let r = replies(&mut out);
    assert_eq!(r[1], (2, "Timeout { owner: 2, key: \"k\" }".to_string()));
    assert_eq!(e.key_count(), 0);
    e.check_invariants();
}

/// After a restart within the leases of the previous run, every key
/// is held by an unknown holder until the grace ends: T at once, a
/// FIFO queue granted at the end, N for any release.
#[test]
fn a_restart_grace_holds_every_key_until_it_ends() {
    let mut e = Engine::new(EngineLimits::default(), 100);
    let mut out = Outbox::new();
    let end = Millis(5_000);
    e.set_restart_grace(end);
    assert_eq!(e.restart_grace(Millis(1_000)), Some(end));
    let t = Millis(1_000);
    for key in ["held-before", "never-seen"] {
        assert_eq!(
            e.acquire(t, 1, acq(key, 1, 0, 5), &mut out),
            AcquireOutcome::Timeout
        );
    }
    assert!(matches!(
        e.acquire(t, 2, acq("held-before", 2, 60, 5), &mut out),
        AcquireOutcome::Queued(_)
    ));
    assert!(matches!(
        e.acquire(t, 3, acq("held-before", 3, 60, 5), &mut out),
        AcquireOutcome::Queued(_)
    ));
    assert!(matches!(
        e.acquire(t, 4, acq("short", 4, 2, 5), &mut out),
        AcquireOutcome::Queued(_)
    ));
    for token in [0, 1, 99, 100] {
        assert!(!e.release(t, 5, token, "held-before", &mut out));
        assert!(!e.extend(t, 5, "held-before", token, 5, &mut out));
    }
    e.check_invariants();
    replies(&mut out);
    // The short wait runs out inside the grace: Timeout, never the key.
    e.tick(Millis(3_000), &mut out);
    assert_eq!(
        replies(&mut out),
        vec![(4, "Timeout { owner: 4, key: \"short\" }".to_string())]
    );
    assert_eq!(e.next_deadline(), Some(end));
    e.tick(Millis(4_999), &mut out);
    assert!(out.is_empty());
    // At the end the head waiter gets the key, FIFO.
    e.tick(end, &mut out);
    assert_eq!(
        replies(&mut out),
        vec![(
            2,
            "Acquired { token: 100, owner: 2, key: \"held-before\" }".to_string()
        )]
    );
    assert_eq!(e.queued_owners("held-before"), vec![3]);
    assert_eq!(e.restart_grace(end), None);
    assert_eq!(
        e.acquire(end, 1, acq("never-seen", 6, 0, 5), &mut out),
        AcquireOutcome::Granted(101)
    );
    assert_eq!(
        e.acquire(end, 1, acq("new", 7, 0, 5), &mut out),
        AcquireOutcome::Granted(102)
    );
    e.check_invariants();
}

#[test]
fn a_lease_above_the_maximum_is_busy_and_grants_track_their_latest_end() {
    let mut e = Engine::new(EngineLimits::default(), 1);
    let mut out = Outbox::new();
    e.set_max_lease(10);
    assert_eq!(
        e.acquire(Millis(0), 1, acq("k", 1, 0, 11), &mut out),
        AcquireOutcome::Busy
    );
    assert_eq!(
        e.acquire(Millis(0), 1, acq("k", 1, 9, 11), &mut out),
        AcquireOutcome::Busy
    );
    assert_eq!(e.granted_until(), Millis::ZERO);
    assert_eq!(e.outstanding_until(Millis(0)), None);
    assert_eq!(
        e.acquire(Millis(0), 1, acq("k", 1, 0, 10), &mut out),
        AcquireOutcome::Granted(1)
    );
    assert_eq!(
        e.acquire(Millis(0), 1, acq("j", 1, 0, 3), &mut out),
        AcquireOutcome::Granted(2)
    );
    assert_eq!(e.granted_until(), Millis(10_001));
    assert_eq!(e.outstanding_until(Millis(0)), Some(Millis(10_001)));
    // An extend past the maximum is refused; one within it moves the
    // latest lease end.
    assert!(!e.extend(Millis(0), 1, "j", 2, 11, &mut out));
    assert!(e.extend(Millis(2_000), 1, "j", 2, 10, &mut out));
    assert_eq!(e.granted_until(), Millis(12_001));
    assert!(e.extend(Millis(2_000), 1, "j", 2, 1, &mut out));
    assert!(e.release(Millis(0), 1, 1, "k", &mut out));
    assert_eq!(
        e.granted_until(),
        Millis(12_001),
        "a release does not lower it"
    );
    assert_eq!(e.outstanding_until(Millis(0)), Some(Millis(3_001)));
    assert_eq!(e.outstanding_until(Millis(3_001)), None, "the lease ended");
}

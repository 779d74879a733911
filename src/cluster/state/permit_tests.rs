//! Protocol 1.2 in the replicated table: a semaphore applied alike on two
//! machines, LimitMismatch answered, each permit expired and extended by
//! its own token, dedup and bound callers as for an acquire, and a
//! snapshot taken mid-queue that goes on as the machine that never took
//! one.

use super::*;
use crate::cluster::command::DecodeError;
use crate::proto::{Mode, Reply};

fn rid(node: u64, seq: u64) -> Rid {
    Rid {
        node,
        epoch: 1,
        seq,
    }
}

/// An acquire with a limit by request `r` on connection `conn`, owner
/// `100 * conn`, lease 10 s.
fn acq_limit(r: Rid, conn: u64, key: &str, limit: u16, mode: Mode, wait_s: u8) -> Command<'_> {
    Command::AcquireWithLimit {
        rid: r,
        floor: 0,
        conn,
        key: key.into(),
        owner: 100 * conn,
        wait_s,
        lease_s: 10,
        limit,
        mode,
    }
}

fn rel(r: Rid, key: &str, token: u64) -> Command<'_> {
    Command::Release {
        rid: r,
        floor: 0,
        conn: 1,
        key: key.into(),
        token,
    }
}

fn expire(key: &str, token: u64, generation: u64) -> Command<'_> {
    Command::Expire {
        key: key.into(),
        token,
        generation,
    }
}

fn kinds(a: &Applied) -> Vec<AnswerKind> {
    a.answers.iter().map(|x| x.kind).collect()
}

/// Everything `a` says, answers, their replies and effects, as text.
fn said(a: &Applied) -> String {
    let replies: Vec<String> = a
        .answers
        .iter()
        .map(|x| format!("{:?} {:?}", x, a.reply(x)))
        .collect();
    let effects: Vec<String> = a
        .effects
        .iter()
        .map(|e| match *e {
            Effect::Granted { key, token, .. } | Effect::Extended { key, token, .. } => {
                format!("{e:?} {} {token}", a.key(key))
            }
            Effect::Queued { key, .. } => format!("{e:?} {}", a.key(key)),
        })
        .collect();
    format!("{replies:?} {effects:?} {}", a.duplicate)
}

/// The commands of a semaphore of 3 taken by five shared acquires and an
/// exclusive one, released, expired and timed out in turns, from index 1.
fn semaphore_script() -> Vec<Command<'static>> {
    let mut v = Vec::new();
    for c in 1..=5 {
        v.push(acq_limit(rid(1, c), c, "sem", 3, Mode::Shared, 30));
    }
    v.push(acq_limit(rid(2, 1), 9, "sem", 3, Mode::Exclusive, 30));
    // Tokens are the entry indices: grants 1, 2, 3; 4 and 5 queue.
    v.push(rel(rid(3, 1), "sem", 2));
    v.push(expire("sem", 1, 0));
    v.push(Command::WaitTimeout {
        key: "sem".into(),
        waiter: rid(1, 5),
    });
    v.push(rel(rid(3, 2), "sem", 3));
    v
}

#[test]
fn a_semaphore_of_3_applies_alike_on_two_machines() {
    let mut a = StateMachine::new(EngineLimits::default());
    let mut b = StateMachine::new(EngineLimits::default());
    let mut all = Vec::new();
    for (i, cmd) in (1..).zip(semaphore_script()) {
        let ra = a.apply(i, &cmd);
        let rb = b.apply(i, &cmd);
        assert_eq!(said(&ra), said(&rb), "entry {i}");
        all.push(ra);
        a.check();
        b.check();
    }
    assert_eq!(a.snapshot(), b.snapshot());
    let granted = |r: &Applied| kinds(r) == [AnswerKind::Acquired(r.answers[0].rid.seq)];
    assert!(granted(&all[0]) && granted(&all[1]) && granted(&all[2]));
    assert_eq!(kinds(&all[3]), [], "the fourth queues");
    // The release of 2 gives its place to the fourth (token 7); the
    // expiry of 1 to the fifth (token 8); the exclusive acquire waits
    // behind them for the key whole.
    assert_eq!(
        kinds(&all[6]),
        [AnswerKind::Released(2), AnswerKind::Acquired(7)]
    );
    assert_eq!(kinds(&all[7]), [AnswerKind::Acquired(8)]);
    assert!(all[7]
        .effects
        .iter()
        .any(|e| matches!(e, Effect::Granted { token: 8, .. })));
    // The fifth was granted already: its wait timer is stale.
    assert_eq!(kinds(&all[8]), []);
    assert_eq!(kinds(&all[9]), [AnswerKind::Released(3)]);
    let tokens: Vec<u64> = a.holders().map(|(_, t, _, _)| t).collect();
    assert_eq!(tokens, [7, 8]);
    assert!(a.is_waiting("sem", rid(2, 1)));
    // Each grant its own: the fourth's request is answered with its token.
    assert_eq!(a.granted_to("sem", rid(1, 4)), Some(7));
    assert_eq!(a.granted_to("sem", rid(1, 5)), Some(8));
    assert_eq!(a.granted_to("sem", rid(1, 1)), None);
}

#[test]
fn a_limit_other_than_the_keys_is_answered_limit_mismatch() {
    let mut sm = StateMachine::new(EngineLimits::default());
    sm.apply(1, &acq_limit(rid(1, 1), 1, "sem", 3, Mode::Shared, 0));
    let r = sm.apply(2, &acq_limit(rid(1, 2), 2, "sem", 2, Mode::Shared, 9));
    assert_eq!(kinds(&r), [AnswerKind::LimitMismatch(3)]);
    assert_eq!(
        format!("{:?}", r.reply(&r.answers[0])),
        format!(
            "{:?}",
            Reply::LimitMismatch {
                owner: 200,
                limit: 3,
                key: "sem"
            }
        )
    );
    assert!(r.effects.is_empty(), "neither granted nor queued");
    // A mutex is a key of limit 1.
    let mutex = Command::Acquire {
        rid: rid(1, 3),
        floor: 0,
        conn: 3,
        key: "m".into(),
        owner: 300,
        wait_s: 0,
        lease_s: 10,
    };
    assert_eq!(kinds(&sm.apply(3, &mutex)), [AnswerKind::Acquired(3)]);
    let r = sm.apply(4, &acq_limit(rid(1, 4), 4, "m", 5, Mode::Exclusive, 9));
    assert_eq!(kinds(&r), [AnswerKind::LimitMismatch(1)]);
    // A plain acquire (`A`) of a permit key gets B: a 1.0 client cannot
    // read L (PROTOCOL §6.2).
    let plain = Command::Acquire {
        rid: rid(1, 5),
        floor: 0,
        conn: 5,
        key: "sem".into(),
        owner: 500,
        wait_s: 0,
        lease_s: 10,
    };
    assert_eq!(kinds(&sm.apply(5, &plain)), [AnswerKind::Busy]);
    sm.check();
}

#[test]
fn each_permit_expires_and_extends_by_its_own_token() {
    let mut sm = StateMachine::new(EngineLimits::default());
    sm.apply(1, &acq_limit(rid(1, 1), 1, "rw", 4, Mode::Shared, 0));
    sm.apply(2, &acq_limit(rid(1, 2), 2, "rw", 4, Mode::Shared, 0));
    let ext = Command::Extend {
        rid: rid(1, 3),
        floor: 0,
        conn: 2,
        key: "rw".into(),
        token: 2,
        lease_s: 20,
    };
    let r = sm.apply(3, &ext);
    assert_eq!(kinds(&r), [AnswerKind::Extended(2)]);
    assert!(matches!(
        r.effects[..],
        [Effect::Extended {
            token: 2,
            generation: 1,
            lease_s: 20,
            ..
        }]
    ));
    assert_eq!(sm.generation_of("rw", 1), Some(0));
    assert_eq!(sm.generation_of("rw", 2), Some(1));
    let holders: Vec<_> = sm.holders().collect();
    assert_eq!(holders, [("rw", 1, 10, 0), ("rw", 2, 20, 1)]);
    // The exclusive acquire waits for both.
    sm.apply(4, &acq_limit(rid(1, 4), 4, "rw", 4, Mode::Exclusive, 30));
    // The extended grant's first timer is stale; the other's is not.
    sm.apply(5, &expire("rw", 2, 0));
    assert!(sm.holds_grant("rw", 2));
    sm.apply(6, &expire("rw", 1, 0));
    assert!(!sm.holds_grant("rw", 1) && sm.holds_grant("rw", 2));
    assert!(sm.is_waiting("rw", rid(1, 4)), "one shared grant stands");
    let r = sm.apply(7, &expire("rw", 2, 1));
    assert_eq!(kinds(&r), [AnswerKind::Acquired(7)]);
    assert!(matches!(r.effects[..], [Effect::Granted { token: 7, .. }]));
    let holders: Vec<_> = sm.holders().collect();
    assert_eq!(holders, [("rw", 7, 10, 0)]);
    sm.check();
}

#[test]
fn an_acquire_with_a_limit_is_deduplicated_and_bound_to_its_caller() {
    const ALICE: Caller = Caller {
        holder: 11,
        admin: false,
    };
    const BOB: Caller = Caller {
        holder: 13,
        admin: false,
    };
    let mut sm = StateMachine::new(EngineLimits::default());
    let cmd = acq_limit(rid(1, 1), 1, "sem", 2, Mode::Shared, 0);
    let r = sm.apply_entry_as(1, None, ALICE, &cmd);
    assert_eq!(kinds(&r), [AnswerKind::Acquired(1)]);
    let again = sm.apply_entry_as(2, None, ALICE, &cmd);
    assert!(again.duplicate && again.answers.is_empty());
    assert!(sm.has_applied(rid(1, 1)));
    let holders: Vec<u64> = sm.engine().grants("sem").map(|g| g.holder).collect();
    assert_eq!(holders, [ALICE.holder]);
    let r = sm.apply_entry_as(3, None, BOB, &rel(rid(2, 1), "sem", 1));
    assert_eq!(kinds(&r), [AnswerKind::NotReleased(1)]);
    let r = sm.apply_entry_as(4, None, ALICE, &rel(rid(2, 2), "sem", 1));
    assert_eq!(kinds(&r), [AnswerKind::Released(1)]);
    assert_eq!(sm.engine().permit_key_count(), 0, "the last place freed");
    sm.check();
}

/// The waiters of `key`, head first, as their requests and whether each
/// asked for a shared place.
fn queue_modes(sm: &StateMachine, key: &str) -> Vec<(Rid, bool)> {
    sm.engine()
        .queue(key)
        .map(|w| (w.tag.rid, w.shared))
        .collect()
}

#[test]
fn a_snapshot_taken_mid_queue_goes_on_as_the_machine_that_never_took_one() {
    let script = semaphore_script();
    let mut a = StateMachine::new(EngineLimits::default());
    // A read/write lock held shared with mixed-mode waiters beside the
    // semaphore.
    let rw = [
        acq_limit(rid(4, 1), 41, "rw", 3, Mode::Shared, 0),
        acq_limit(rid(4, 2), 42, "rw", 3, Mode::Exclusive, 50),
        acq_limit(rid(4, 3), 43, "rw", 3, Mode::Shared, 50),
    ];
    let mut i = 0;
    for cmd in script[..6].iter().chain(&rw) {
        i += 1;
        a.apply(i, cmd);
    }
    let bytes = a.snapshot();
    assert_eq!(bytes[0], 6, "a table with permit keys is a version 6 one");
    let mut b = StateMachine::restore(EngineLimits::default(), &bytes).unwrap();
    b.check();
    assert_eq!(b.snapshot(), bytes);
    assert_eq!(
        queue_modes(&b, "rw"),
        [(rid(4, 2), false), (rid(4, 3), true)],
        "each waiter's mode survives"
    );
    assert_eq!(queue_modes(&b, "sem"), queue_modes(&a, "sem"));
    assert_eq!(
        a.holders().collect::<Vec<_>>(),
        b.holders().collect::<Vec<_>>()
    );
    let rest = script[6..].iter().cloned().chain([
        rel(rid(4, 9), "rw", 7),
        acq_limit(rid(5, 1), 51, "rw", 3, Mode::Shared, 9),
        Command::CancelWaiters {
            origin: rid(4, 0).origin(43),
        },
    ]);
    for cmd in rest {
        i += 1;
        let ra = a.apply(i, &cmd);
        let rb = b.apply(i, &cmd);
        assert_eq!(said(&ra), said(&rb), "entry {i}: {cmd:?}");
        b.check();
    }
    assert_eq!(a.snapshot(), b.snapshot());
    // Once no key has a limit, the table is written as version 5 again.
    for origin in [rid(2, 0).origin(9), rid(5, 0).origin(51)] {
        i += 1;
        a.apply(i, &Command::CancelWaiters { origin });
    }
    let held: Vec<(String, u64)> = a.holders().map(|(k, t, _, _)| (k.to_owned(), t)).collect();
    for (key, token) in held {
        i += 1;
        let r = a.apply(i, &rel(rid(6, i), &key, token));
        assert_eq!(kinds(&r), [AnswerKind::Released(token)], "nobody waits");
    }
    a.check();
    assert_eq!(
        a.engine().permit_key_count(),
        0,
        "{:?}",
        a.engine().sorted_permit_keys()
    );
    assert_eq!(a.snapshot()[0], 5);
}

#[test]
fn a_version_5_snapshot_restores_with_no_permit_key_and_a_bad_mode_is_refused() {
    let mut sm = StateMachine::new(EngineLimits::default());
    let mutex = Command::Acquire {
        rid: rid(1, 1),
        floor: 0,
        conn: 1,
        key: "m".into(),
        owner: 1,
        wait_s: 0,
        lease_s: 10,
    };
    sm.apply(1, &mutex);
    let v5 = sm.snapshot();
    assert_eq!(v5[0], 5);
    let back = StateMachine::restore(EngineLimits::default(), &v5).unwrap();
    assert_eq!(back.engine().permit_key_count(), 0);
    assert_eq!(back.snapshot(), v5);
    // A permit key makes it a version 6 one.
    sm.apply(2, &acq_limit(rid(1, 2), 2, "p", 2, Mode::Exclusive, 0));
    let v6 = sm.snapshot();
    assert_eq!(v6[0], 6);
    let back = StateMachine::restore(EngineLimits::default(), &v6).unwrap();
    assert_eq!(back.snapshot(), v6);
    assert_eq!(
        back.engine()
            .grants("p")
            .map(|g| g.exclusive)
            .collect::<Vec<_>>(),
        [true]
    );
    // The mode byte of the permit's grant: after the key, the limit, the
    // grant count, the token and the holder.
    let at = v6
        .windows(3)
        .position(|w| w == [0, 1, b'p'])
        .expect("the permit key")
        + 3
        + 2
        + 4
        + 8
        + 8;
    assert_eq!(v6[at], b'X');
    // Version 6 bytes without a permit key are not a snapshot we write.
    let mut empty = v5.clone();
    empty[0] = 6;
    // After the header and the one mutex "m" (key, token, holder, tag,
    // waiter count), an empty permit section.
    let image_end = 1 + 8 + 8 + 4 + (4 + 1) + 8 + 8 + (1 + 8 + 24) + 4;
    empty.splice(image_end..image_end, 0u32.to_be_bytes());
    assert_eq!(
        StateMachine::restore(EngineLimits::default(), &empty).unwrap_err(),
        DecodeError::Invalid("version 6 without permit keys")
    );
    let mut bad = v6.clone();
    bad[at] = b'Q';
    assert_eq!(
        StateMachine::restore(EngineLimits::default(), &bad).unwrap_err(),
        DecodeError::Invalid("mode")
    );
    for cut in 0..v6.len() {
        assert!(StateMachine::restore(EngineLimits::default(), &v6[..cut]).is_err());
    }
}

#[test]
fn a_table_full_of_permit_keys_snapshots_within_the_bound_and_its_stated_extra() {
    let limits = EngineLimits {
        max_keys: 40,
        max_waiters: 80,
        max_waiters_per_key: 2,
        ..EngineLimits::default()
    };
    let max_key_bytes = 300;
    let mut sm = StateMachine::new(limits.clone());
    let mut index = 0;
    // Every key registered with a limit and one exclusive grant (the
    // costliest shape), the longest key, every waiter queued in a mode.
    for k in 0..limits.max_keys as u64 {
        let key = format!("{k:0>300}");
        index += 1;
        let cmd = acq_limit(rid(1, index), 1_000 + k, &key, 2, Mode::Exclusive, 0);
        assert!(matches!(
            kinds(&sm.apply(index, &cmd))[..],
            [AnswerKind::Acquired(_)]
        ));
        for w in 0..limits.max_waiters_per_key as u64 {
            index += 1;
            let mode = if w == 0 {
                Mode::Shared
            } else {
                Mode::Exclusive
            };
            let cmd = acq_limit(rid(2, index), 10_000 + index, &key, 2, mode, 9);
            assert!(sm.apply(index, &cmd).answers.is_empty());
        }
    }
    assert_eq!(sm.engine().permit_key_count(), limits.max_keys);
    assert_eq!(sm.engine().waiter_count(), limits.max_waiters);
    sm.check();
    let bytes = sm.snapshot();
    let bound = StateMachine::snapshot_bound(&limits, max_key_bytes);
    assert!(bytes.len() as u64 <= bound);
    // What the permits add beyond the table's part of the bound is at
    // most what the bound's documentation says comes out of the slack.
    let table = bound - SNAPSHOT_LEDGER_SLACK_BYTES;
    let extra = 7 * limits.max_keys as u64 + limits.max_waiters as u64 + 4;
    let ledger = {
        // The ledger and the connection map, as a table of mutexes
        // writes them: everything after the image.
        let image_len = {
            let mut v = Vec::new();
            let codec = snapshot::ReqCodec { version: 6 };
            sm.engine().write_image(&codec, &mut v);
            v.len() as u64
        };
        bytes.len() as u64 - (1 + 8 + 8) - image_len
    };
    assert!(bytes.len() as u64 - ledger <= table + extra);
    let back = StateMachine::restore(limits, &bytes).unwrap();
    assert_eq!(back.snapshot(), bytes);
}

/// A cancelled exclusive waiter at the head of a read lock's queue lets
/// the shared waiter behind it in: that grant is answered and timed (an
/// `Effect::Granted`, so the leader sets its Expire), its connection is
/// forgotten once it has no waiter left, and the table still checks and
/// restores from its own snapshot.
#[test]
fn a_cancelled_head_waiter_hands_its_turn_on_with_an_answer() {
    let mut sm = StateMachine::new(EngineLimits::default());
    let cmds = [
        acq_limit(rid(1, 1), 1, "rw", 3, Mode::Shared, 0),
        acq_limit(rid(2, 1), 2, "rw", 3, Mode::Exclusive, 5),
        acq_limit(rid(3, 1), 3, "rw", 3, Mode::Shared, 5),
    ];
    let mut i = 0;
    for cmd in &cmds {
        i += 1;
        sm.apply(i, cmd);
    }
    assert_eq!(
        queue_modes(&sm, "rw"),
        [(rid(2, 1), false), (rid(3, 1), true)]
    );
    i += 1;
    let r = sm.apply(
        i,
        &Command::CancelWaiters {
            origin: rid(2, 1).origin(2),
        },
    );
    let [answer] = r.answers.as_slice() else {
        panic!("one answer: {}", said(&r));
    };
    let AnswerKind::Acquired(token) = answer.kind else {
        panic!("a grant: {}", said(&r));
    };
    assert_eq!((answer.rid, answer.conn), (rid(3, 1), 3));
    assert!(
        r.effects
            .iter()
            .any(|e| matches!(e, Effect::Granted { token: t, .. } if *t == token)),
        "the grant is timed: {}",
        said(&r)
    );
    assert!(queue_modes(&sm, "rw").is_empty());
    sm.check();
    let bytes = sm.snapshot();
    let back = StateMachine::restore(EngineLimits::default(), &bytes).unwrap();
    back.check();
    assert_eq!(back.snapshot(), bytes);
}

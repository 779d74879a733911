//! State machine tests: applying commands, answers and effects, dedup,
//! snapshots.

use super::*;
use crate::cluster::command::Writer;
use crate::proto::Reply;

fn rid(node: u64, seq: u64) -> Rid {
    Rid {
        node,
        epoch: 1,
        seq,
    }
}

fn acq(r: Rid, conn: u64, key: &str, owner: u64, wait_s: u8) -> Command<'_> {
    Command::Acquire {
        rid: r,
        floor: 0,
        conn,
        key: key.into(),
        owner,
        wait_s,
        lease_s: 10,
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

fn kinds(a: &Applied) -> Vec<(Rid, AnswerKind)> {
    a.answers.iter().map(|x| (x.rid, x.kind)).collect()
}

#[test]
fn a_table_full_to_its_limits_snapshots_within_the_bound() {
    let limits = EngineLimits {
        max_keys: 40,
        max_waiters: 80,
        max_waiters_per_key: 2,
        ..EngineLimits::default()
    };
    let max_key_bytes = 300;
    let mut sm = StateMachine::new(limits.clone());
    let mut index = 0;
    let mut seq = 0;
    let mut next = |node: u64| {
        index += 1;
        seq += 1;
        (index, rid(node, seq))
    };
    // Every key registered with the longest key, every waiter queued,
    // each from its own client connection.
    for k in 0..limits.max_keys {
        let key = format!("{k:0>300}");
        let (i, r) = next(1);
        let granted = sm.apply(i, &acq(r, 1_000 + k as u64, &key, 1, 0));
        assert!(matches!(granted.answers[0].kind, AnswerKind::Acquired(_)));
        for w in 0..limits.max_waiters_per_key {
            let (i, r) = next(2);
            let conn = 10_000 + (k * 10 + w) as u64;
            assert!(sm.apply(i, &acq(r, conn, &key, 2, 9)).answers.is_empty());
        }
    }
    assert_eq!(sm.key_count(), limits.max_keys);
    assert_eq!(sm.engine.waiter_count(), limits.max_waiters);
    sm.check();
    let bytes = sm.snapshot().len() as u64;
    let bound = StateMachine::snapshot_bound(&limits, max_key_bytes);
    assert!(bytes <= bound, "{bytes} bytes over the bound {bound}");
    // Without its slack the bound is tight: the keys and waiters alone
    // fill it (the ledger and the connection map come on top).
    let table = bound - SNAPSHOT_LEDGER_SLACK_BYTES;
    assert!(bytes >= table, "{bytes} bytes, table bound {table}");
    // Restored, it gives the same bytes.
    let back = StateMachine::restore(limits, &sm.snapshot()).unwrap();
    assert_eq!(back.snapshot().len() as u64, bytes);
}

#[test]
fn a_32_bit_build_refuses_limits_whose_snapshot_it_could_not_hold() {
    let defaults = EngineLimits::default();
    let key_bytes = crate::limits::DEFAULT_MAX_KEY_BYTES;
    let bound = StateMachine::snapshot_bound(&defaults, key_bytes);
    assert_eq!(bound.div_ceil(1 << 20), 1100);
    // 64-bit: the default table fits, and so does a much larger one.
    let wide = i64::MAX as u64;
    assert_eq!(
        StateMachine::check_snapshot_fits(&defaults, key_bytes, wide),
        Ok(bound)
    );
    let big = EngineLimits {
        max_keys: 100_000_000,
        ..defaults.clone()
    };
    assert!(StateMachine::check_snapshot_fits(&big, key_bytes, wide).is_ok());
    // 32-bit: the default table does not; the message names the flags
    // and the largest --max-keys that does, which is exact.
    let narrow = i32::MAX as u64;
    let err = StateMachine::check_snapshot_fits(&defaults, key_bytes, narrow)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("--max-keys 1000000") && err.contains("1100 MiB"),
        "{err}"
    );
    assert!(err.contains(&format!("{}-bit", usize::BITS)), "{err}");
    let fit: usize = err
        .split("use --max-keys ")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no --max-keys hint in {err}"));
    assert_eq!(fit, 926_579, "the figure docs/CLUSTER.md gives");
    let at = |max_keys| EngineLimits {
        max_keys,
        ..defaults.clone()
    };
    let ok = StateMachine::check_snapshot_fits(&at(fit), key_bytes, narrow).unwrap();
    assert!(ok <= narrow / 2);
    assert!(StateMachine::check_snapshot_fits(&at(fit + 1), key_bytes, narrow).is_err());
    // Waiters alone over the room: the hint says so.
    let waiters = EngineLimits {
        max_waiters: 30_000_000,
        ..defaults
    };
    let err = StateMachine::check_snapshot_fits(&waiters, key_bytes, narrow)
        .unwrap_err()
        .to_string();
    assert!(err.contains("a smaller --max-waiters"), "{err}");
}

/// Applies entry `index` holding `cmd` (no token bits, the default
/// caller) into `res`.
fn apply_into(sm: &mut StateMachine, index: u64, cmd: &Command, res: &mut Applied) {
    sm.apply_entry_into(index, None, Caller::default(), cmd, res);
}

/// The wire replies of `res`'s answers, as text.
fn replies(res: &Applied) -> Vec<String> {
    res.answers
        .iter()
        .map(|a| format!("{:?}", res.reply(a)))
        .collect()
}

/// Each effect of `res` as its key and its token (a queued acquire's
/// request sequence number).
fn effects(res: &Applied) -> Vec<(String, u64)> {
    res.effects
        .iter()
        .map(|e| match *e {
            Effect::Granted { key, token, .. } | Effect::Extended { key, token, .. } => {
                (res.key(key).to_owned(), token)
            }
            Effect::Queued { key, waiter, .. } => (res.key(key).to_owned(), waiter.seq),
        })
        .collect()
}

#[test]
fn answers_and_effects_name_their_keys_in_a_reused_applied() {
    let mut sm = StateMachine::new(EngineLimits::default());
    let mut res = Applied::default();
    apply_into(
        &mut sm,
        5,
        &acq(rid(1, 1), 7, "a-longer-key", 100, 0),
        &mut res,
    );
    assert_eq!(
        replies(&res),
        [format!(
            "{:?}",
            Reply::Acquired {
                token: 5,
                owner: 100,
                key: "a-longer-key"
            }
        )]
    );
    assert_eq!(effects(&res), [("a-longer-key".to_owned(), 5)]);
    // A shorter key next: nothing of the previous entry's is left.
    apply_into(&mut sm, 6, &acq(rid(2, 1), 8, "b", 200, 0), &mut res);
    apply_into(&mut sm, 7, &acq(rid(3, 1), 9, "b", 300, 9), &mut res);
    assert!(res.answers.is_empty());
    assert_eq!(effects(&res), [("b".to_owned(), 1)]);
    apply_into(&mut sm, 8, &rel(rid(2, 2), "b", 6), &mut res);
    assert_eq!(
        replies(&res),
        [
            format!("{:?}", Reply::Released { token: 6, key: "b" }),
            format!(
                "{:?}",
                Reply::Acquired {
                    token: 8,
                    owner: 300,
                    key: "b"
                }
            ),
        ]
    );
    assert_eq!(effects(&res), [("b".to_owned(), 8)]);
    // A duplicate: cleared, nothing in it.
    apply_into(&mut sm, 9, &rel(rid(2, 2), "b", 6), &mut res);
    assert!(res.duplicate && res.answers.is_empty() && res.effects.is_empty());
    sm.check();
}

#[test]
fn tokens_are_entry_indices_and_release_hands_over_fifo() {
    let mut sm = StateMachine::new(EngineLimits::default());
    let a = sm.apply(5, &acq(rid(1, 1), 7, "k", 100, 0));
    assert_eq!(kinds(&a), vec![(rid(1, 1), AnswerKind::Acquired(5))]);
    assert!(sm
        .apply(6, &acq(rid(2, 1), 8, "k", 200, 9))
        .answers
        .is_empty());
    assert!(sm
        .apply(7, &acq(rid(3, 1), 9, "k", 300, 9))
        .answers
        .is_empty());
    let a = sm.apply(8, &acq(rid(1, 2), 7, "k", 101, 0));
    assert_eq!(kinds(&a), vec![(rid(1, 2), AnswerKind::Timeout)]);
    sm.check();
    let a = sm.apply(12, &rel(rid(1, 3), "k", 5));
    assert_eq!(
        kinds(&a),
        vec![
            (rid(1, 3), AnswerKind::Released(5)),
            (rid(2, 1), AnswerKind::Acquired(12))
        ]
    );
    assert_eq!(a.answers[1].conn, 8);
    sm.check();
    let a = sm.apply(13, &rel(rid(1, 4), "k", 5));
    assert_eq!(kinds(&a), vec![(rid(1, 4), AnswerKind::NotReleased(5))]);
    // A stale expire does nothing; the current one hands over.
    assert_eq!(
        sm.apply(
            14,
            &Command::Expire {
                key: "k".into(),
                token: 5,
                generation: 0,
            }
        ),
        Applied::default()
    );
    let a = sm.apply(
        15,
        &Command::Expire {
            key: "k".into(),
            token: 12,
            generation: 0,
        },
    );
    assert_eq!(kinds(&a), vec![(rid(3, 1), AnswerKind::Acquired(15))]);
    let a = sm.apply(
        16,
        &Command::Expire {
            key: "k".into(),
            token: 15,
            generation: 0,
        },
    );
    assert!(a.answers.is_empty());
    assert_eq!(sm.key_count(), 0);
    sm.check();
}

#[test]
fn duplicates_apply_once_and_floors_forget() {
    let mut sm = StateMachine::new(EngineLimits::default());
    let c = acq(rid(1, 1), 7, "k", 100, 0);
    assert_eq!(sm.apply(1, &c).answers.len(), 1);
    let again = sm.apply(2, &c);
    assert!(again.duplicate && again.answers.is_empty());
    // floor 5 forgets seqs below 5: seq 3 is then treated as applied.
    let c2 = Command::Acquire {
        rid: rid(1, 6),
        floor: 5,
        conn: 7,
        key: "j".into(),
        owner: 1,
        wait_s: 0,
        lease_s: 1,
    };
    assert!(!sm.apply(3, &c2).duplicate);
    assert!(sm.apply(4, &acq(rid(1, 3), 7, "x", 5, 0)).duplicate);
    assert!(!sm.apply(5, &acq(rid(1, 7), 7, "x", 5, 0)).duplicate);
    // A newer boot of node 1 starts afresh; the older boot is then stale.
    let newer = Rid {
        node: 1,
        epoch: 2,
        seq: 1,
    };
    assert!(!sm.apply(6, &acq(newer, 7, "y", 5, 0)).duplicate);
    assert!(sm.apply(7, &acq(rid(1, 8), 7, "z", 5, 0)).duplicate);
    sm.check();
}

#[test]
fn wait_timeout_and_cancel_are_validated() {
    let mut sm = StateMachine::new(EngineLimits::default());
    sm.apply(1, &acq(rid(1, 1), 7, "k", 100, 0));
    sm.apply(2, &acq(rid(2, 1), 8, "k", 200, 9));
    sm.apply(3, &acq(rid(2, 2), 8, "k", 201, 9));
    sm.apply(4, &acq(rid(3, 1), 9, "k", 300, 9));
    let a = sm.apply(
        5,
        &Command::WaitTimeout {
            key: "k".into(),
            waiter: rid(2, 1),
        },
    );
    assert_eq!(kinds(&a), vec![(rid(2, 1), AnswerKind::Timeout)]);
    let a = sm.apply(
        6,
        &Command::WaitTimeout {
            key: "k".into(),
            waiter: rid(2, 1),
        },
    );
    assert!(a.answers.is_empty());
    sm.apply(
        7,
        &Command::CancelWaiters {
            origin: rid(2, 0).origin(8),
        },
    );
    sm.check();
    // Node 4 queues, restarts (epoch 2): its old waiter is dropped by the
    // first command of the new boot.
    sm.apply(8, &acq(rid(4, 1), 5, "k", 400, 9));
    assert!(sm.is_waiting("k", rid(4, 1)));
    let newer = Rid {
        node: 4,
        epoch: 2,
        seq: 1,
    };
    sm.apply(9, &acq(newer, 5, "other", 401, 0));
    assert!(!sm.is_waiting("k", rid(4, 1)));
    sm.check();
    let a = sm.apply(10, &rel(rid(1, 2), "k", 1));
    assert_eq!(
        kinds(&a),
        vec![
            (rid(1, 2), AnswerKind::Released(1)),
            (rid(3, 1), AnswerKind::Acquired(10))
        ]
    );
    sm.check();
}

#[test]
fn the_holders_request_survives_a_snapshot() {
    let mut a = StateMachine::new(EngineLimits::default());
    a.apply(1, &acq(rid(1, 1), 7, "k", 100, 0));
    a.apply(2, &acq(rid(2, 1), 8, "k", 200, 9));
    assert_eq!(a.granted_to("k", rid(1, 1)), Some(1));
    assert_eq!(a.granted_to("k", rid(2, 1)), None, "queued, not granted");
    assert!(a.has_applied(rid(1, 1)) && a.has_applied(rid(2, 1)));
    assert!(!a.has_applied(rid(1, 2)) && !a.has_applied(rid(3, 1)));
    // Handed over on release: the waiter's request holds it now.
    a.apply(3, &rel(rid(1, 2), "k", 1));
    assert_eq!(a.granted_to("k", rid(1, 1)), None);
    assert_eq!(a.granted_to("k", rid(2, 1)), Some(3));
    let b = StateMachine::restore(EngineLimits::default(), &a.snapshot()).unwrap();
    assert_eq!(b.granted_to("k", rid(2, 1)), Some(3));
    assert!(b.has_applied(rid(1, 2)) && !b.has_applied(rid(1, 3)));
    // A version-1 snapshot (no holder requests) still restores, with
    // the holder's request unknown.
    let mut w = Writer::default();
    w.u8(1);
    w.u64(4);
    w.u64(1);
    w.u32(1);
    w.key("k");
    w.u64(3);
    w.u8(10);
    w.u32(0);
    w.u32(0);
    w.u32(0);
    let old = StateMachine::restore(EngineLimits::default(), &w.buf).unwrap();
    old.check();
    assert_eq!(old.holder("k"), Some(3));
    assert_eq!(old.granted_to("k", rid(2, 1)), None);
}

#[test]
fn snapshot_restores_an_identical_machine() {
    let mut a = StateMachine::new(EngineLimits::default());
    let cmds = [
        acq(rid(1, 1), 7, "b", 1, 0),
        acq(rid(1, 2), 7, "a", 2, 0),
        acq(rid(2, 1), 8, "b", 3, 9),
        acq(rid(3, 1), 9, "b", 4, 9),
        acq(rid(2, 2), 8, "a", 5, 9),
        rel(rid(1, 3), "b", 1),
    ];
    for (i, c) in cmds.iter().enumerate() {
        a.apply(i as u64 + 1, c);
    }
    let bytes = a.snapshot();
    let mut b = StateMachine::restore(EngineLimits::default(), &bytes).unwrap();
    b.check();
    assert_eq!(b.snapshot(), bytes);
    // Both continue identically.
    let more = [
        rel(rid(1, 4), "a", 2),
        Command::Expire {
            key: "b".into(),
            token: 6,
            generation: 0,
        },
        acq(rid(1, 5), 7, "c", 6, 0),
        Command::CancelWaiters {
            origin: rid(3, 0).origin(9),
        },
    ];
    for (i, c) in more.iter().enumerate() {
        let idx = 20 + i as u64;
        assert_eq!(a.apply(idx, c), b.apply(idx, c));
    }
    a.check();
    b.check();
    assert_eq!(a.snapshot(), b.snapshot());
    // Truncated or corrupt snapshots are errors, not panics.
    for cut in 0..bytes.len() {
        assert!(StateMachine::restore(EngineLimits::default(), &bytes[..cut]).is_err());
    }
}

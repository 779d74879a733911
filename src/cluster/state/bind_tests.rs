//! Grants bound to their takers' identities: applied from the entries'
//! callers, and kept by snapshots (version 5) and by older snapshots read
//! back (holder 0).

use super::*;
use crate::cluster::command::{DecodeError, Writer};

/// Two authenticated identities (odd holder numbers) and the admin.
const ALICE: Caller = Caller {
    holder: 0x5A5A_5A5A_5A5A_5A11,
    admin: false,
};
const BOB: Caller = Caller {
    holder: 0x5A5A_5A5A_5A5A_5A23,
    admin: false,
};
const ADMIN: Caller = Caller {
    holder: 0,
    admin: true,
};

fn rid(node: u64, seq: u64) -> Rid {
    Rid {
        node,
        epoch: 1,
        seq,
    }
}

fn acq(r: Rid, conn: u64, key: &str, wait_s: u8) -> Command<'_> {
    Command::Acquire {
        rid: r,
        floor: 0,
        conn,
        key: key.into(),
        owner: r.seq,
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

fn ext(r: Rid, key: &str, token: u64) -> Command<'_> {
    Command::Extend {
        rid: r,
        floor: 0,
        conn: 1,
        key: key.into(),
        token,
        lease_s: 20,
    }
}

fn kinds(a: &Applied) -> Vec<AnswerKind> {
    a.answers.iter().map(|x| x.kind).collect()
}

/// A table where ALICE holds "k" (token 1) and BOB waits for it and for
/// "j" (held by the default caller, token 2), both from his connection 8.
fn alice_holds_bob_waits() -> StateMachine {
    let mut sm = StateMachine::new(EngineLimits::default());
    sm.apply_entry_as(1, None, ALICE, &acq(rid(1, 1), 7, "k", 0));
    sm.apply_entry_as(2, None, Caller::default(), &acq(rid(3, 1), 9, "j", 0));
    sm.apply_entry_as(3, None, BOB, &acq(rid(2, 1), 8, "k", 9));
    sm.apply_entry_as(4, None, BOB, &acq(rid(2, 2), 8, "j", 9));
    sm.check();
    sm
}

#[test]
fn a_grant_is_bound_to_its_taker_on_apply() {
    let mut sm = StateMachine::new(EngineLimits::default());
    let a = sm.apply_entry_as(1, None, ALICE, &acq(rid(1, 1), 7, "k", 0));
    assert_eq!(kinds(&a), [AnswerKind::Acquired(1)]);
    assert_eq!(sm.engine().grant_holder("k"), Some(ALICE.holder));
    // Another identity, or an unknown one, with the right token: N and X,
    // and the grant stays.
    for (seq, who) in [(1, BOB), (2, Caller::default())] {
        let r = sm.apply_entry_as(10 + seq, None, who, &rel(rid(2, seq), "k", 1));
        assert_eq!(kinds(&r), [AnswerKind::NotReleased(1)], "{who:?}");
        let x = sm.apply_entry_as(20 + seq, None, who, &ext(rid(2, 10 + seq), "k", 1));
        assert_eq!(kinds(&x), [AnswerKind::NotExtended(1)], "{who:?}");
        assert!(x.effects.is_empty());
    }
    assert_eq!(sm.lease_of("k"), Some((1, 0)));
    // The taker extends it; BOB queues, and gets it when ALICE releases.
    let x = sm.apply_entry_as(30, None, ALICE, &ext(rid(1, 2), "k", 1));
    assert_eq!(kinds(&x), [AnswerKind::Extended(1)]);
    sm.apply_entry_as(31, None, BOB, &acq(rid(2, 30), 8, "k", 9));
    let r = sm.apply_entry_as(32, None, ALICE, &rel(rid(1, 3), "k", 1));
    assert_eq!(
        kinds(&r),
        [AnswerKind::Released(1), AnswerKind::Acquired(32)]
    );
    // Handed over, the grant is BOB's: ALICE may no longer release it.
    assert_eq!(sm.engine().grant_holder("k"), Some(BOB.holder));
    let r = sm.apply_entry_as(33, None, ALICE, &rel(rid(1, 4), "k", 32));
    assert_eq!(kinds(&r), [AnswerKind::NotReleased(32)]);
    // The admin identity may, with the token (as a node releasing a
    // grant nobody saw does).
    let r = sm.apply_entry_as(34, None, ADMIN, &rel(rid(1, 5), "k", 32));
    assert_eq!(kinds(&r), [AnswerKind::Released(32)]);
    // The caller lasts one command: a timer's entry after it is unbound.
    assert_eq!(sm.engine().grant_holder("k"), None);
    let a = sm.apply(35, &acq(rid(3, 1), 9, "k", 0));
    assert_eq!(kinds(&a), [AnswerKind::Acquired(35)]);
    assert_eq!(sm.engine().grant_holder("k"), Some(0));
    sm.check();
}

#[test]
fn holders_survive_a_version_5_snapshot() {
    let a = alice_holds_bob_waits();
    let bytes = a.snapshot();
    assert_eq!(bytes[0], 5);
    let mut b = StateMachine::restore(EngineLimits::default(), &bytes).unwrap();
    b.check();
    assert_eq!(b.snapshot(), bytes);
    assert_eq!(b.engine().grant_holder("k"), Some(ALICE.holder));
    assert_eq!(b.engine().grant_holder("j"), Some(0));
    for key in ["k", "j"] {
        let holders: Vec<u64> = b.engine().queue(key).map(|w| w.holder).collect();
        assert_eq!(holders, [BOB.holder], "{key}");
    }
    // The restored table enforces the binding as the one it came from.
    let mut a = a;
    for sm in [&mut a, &mut b] {
        let r = sm.apply_entry_as(10, None, BOB, &rel(rid(2, 3), "k", 1));
        assert_eq!(kinds(&r), [AnswerKind::NotReleased(1)]);
        let r = sm.apply_entry_as(11, None, ALICE, &rel(rid(1, 2), "k", 1));
        assert_eq!(
            kinds(&r),
            [AnswerKind::Released(1), AnswerKind::Acquired(11)]
        );
        assert_eq!(sm.engine().grant_holder("k"), Some(BOB.holder));
    }
    assert_eq!(a.snapshot(), b.snapshot());
}

#[test]
fn a_version_5_snapshot_whose_connection_has_two_holders_is_refused() {
    let bytes = alice_holds_bob_waits().snapshot();
    let bob = BOB.holder.to_be_bytes();
    let at: Vec<usize> = bytes
        .windows(8)
        .enumerate()
        .filter(|(_, w)| *w == bob)
        .map(|(i, _)| i)
        .collect();
    assert_eq!(at.len(), 2, "BOB's two waiters");
    let mut bad = bytes.clone();
    bad[at[1] + 7] ^= 0x02;
    assert_eq!(
        StateMachine::restore(EngineLimits::default(), &bad).unwrap_err(),
        DecodeError::Invalid("waiter holder")
    );
    for cut in 0..bytes.len() {
        assert!(StateMachine::restore(EngineLimits::default(), &bytes[..cut]).is_err());
    }
}

/// A snapshot of `version`, written field by field: one key "k" held
/// with token 4 (lease 10, generation 2, request (1, 1)) and one waiter
/// (request (2, 1) on its connection 8, owner 200, wait 9, lease 7).
/// Version 5 has holder numbers (`holders`: the grant's, the waiter's).
fn table(version: u8, holders: (u64, u64)) -> Vec<u8> {
    let mut w = Writer::default();
    w.u8(version);
    w.u64(9); // next token
    w.u64(2); // next engine connection
    w.u32(1); // keys
    w.key("k");
    w.u64(4); // token
    if version >= 5 {
        w.u64(holders.0);
    }
    w.u8(10); // lease
    w.u64(2); // generation
    w.rid(rid(1, 1));
    w.u32(1); // waiters
    w.rid(rid(2, 1));
    w.u64(8); // origin connection
    if version >= 5 {
        w.u64(holders.1);
    }
    w.u64(200); // owner
    w.u8(9);
    w.u8(7);
    w.u32(1); // dedup
    w.u64(2);
    w.u64(1);
    w.u64(0);
    w.u32(1);
    w.u64(1);
    w.u32(1); // connections
    w.origin(rid(2, 0).origin(8));
    w.u64(1);
    if version >= 4 {
        w.u64(0); // members: no addresses, no removed ids
    }
    w.buf
}

/// The engine's image keeps the older layouts byte for byte: a version 3
/// or 4 snapshot written field by field restores, unbound, and writes
/// back as version 5 with holder numbers 0.
#[test]
fn version_3_and_4_snapshots_read_and_write_back_as_version_5() {
    for version in [3, 4] {
        let old = table(version, (0, 0));
        let sm = StateMachine::restore(EngineLimits::default(), &old).unwrap();
        sm.check();
        assert_eq!(sm.lease_of("k"), Some((4, 2)));
        assert_eq!(sm.granted_to("k", rid(1, 1)), Some(4));
        assert!(sm.is_waiting("k", rid(2, 1)));
        assert_eq!(sm.engine().grant_holder("k"), Some(0));
        assert_eq!(sm.snapshot(), table(5, (0, 0)), "version {version}");
        // A connection id the table never allocated is refused.
        let mut bad = old.clone();
        let at = bad.len() - 1 - if version >= 4 { 8 } else { 0 };
        bad[at] = 5;
        assert!(StateMachine::restore(EngineLimits::default(), &bad).is_err());
    }
    let v5 = table(5, (ALICE.holder, BOB.holder));
    let sm = StateMachine::restore(EngineLimits::default(), &v5).unwrap();
    sm.check();
    assert_eq!(sm.engine().grant_holder("k"), Some(ALICE.holder));
    assert_eq!(sm.snapshot(), v5);
}

use super::*;

const S: Duration = Duration::from_secs(1);

fn reply(r: &Reply<'_>) -> Vec<u8> {
    let mut v = Vec::new();
    proto::encode_reply(r, &mut v);
    v
}

/// The one request in `bytes`: (wait_s, lease_s, owner) or a release.
fn acquire_sent(bytes: &[u8]) -> (u8, u8, u64) {
    match proto::decode_request(bytes, 1024) {
        Decoded::Frame {
            frame:
                Request::Acquire {
                    wait_s,
                    lease_s,
                    owner,
                    ..
                },
            used,
        } => {
            assert_eq!(used, bytes.len(), "one frame");
            (wait_s, lease_s, owner)
        }
        other => panic!("not one acquire: {other:?}"),
    }
}

fn sent(m: &mut Machine, now: Millis) -> Vec<u8> {
    let mut v = Vec::new();
    m.transmit(now, &mut v);
    v
}

#[test]
fn the_wire_wait_is_the_time_left_when_written_rounded_up() {
    let mut m = Machine::new(1);
    let id = m.acquire(Millis(0), "db", 10 * S, 5 * S).unwrap();
    let (wait_s, lease_s, owner) = acquire_sent(&sent(&mut m, Millis(2_500)));
    assert_eq!((wait_s, lease_s), (8, 5), "7.5 s left, rounded up");
    m.receive(
        Millis(3_000),
        &reply(&Reply::Acquired {
            token: 9,
            owner,
            key: "db",
        }),
    );
    let Some((got, Outcome::Acquire(AcquireOutcome::Acquired(held)))) = m.poll_outcome() else {
        panic!("not acquired");
    };
    assert_eq!(got, id);
    assert_eq!(held.token, 9);
    assert_eq!(
        held.expires_at,
        Millis(7_500),
        "written + lease, not replied + lease"
    );
    assert!(!held.is_expired(Millis(7_499)) && held.is_expired(Millis(7_500)));
}

#[test]
fn a_request_still_queued_at_d_is_never_sent_and_times_out() {
    let mut m = Machine::new(1);
    let id = m.acquire(Millis(0), "db", 2 * S, 5 * S).unwrap();
    assert_eq!(m.next_timeout(), Some(Millis(2_000)));
    assert!(sent(&mut m, Millis(2_000)).is_empty());
    assert_eq!(
        m.poll_outcome(),
        Some((id, Outcome::Acquire(AcquireOutcome::Timeout)))
    );
    // The same by the clock alone.
    let id = m.acquire(Millis(0), "db", 2 * S, 5 * S).unwrap();
    m.handle_timeout(Millis(2_000));
    assert_eq!(
        m.poll_outcome(),
        Some((id, Outcome::Acquire(AcquireOutcome::Timeout)))
    );
    assert_eq!(m.pending(), 0);
}

#[test]
fn no_reply_by_d_plus_the_grace_closes_the_session_as_indeterminate() {
    let mut m = Machine::new(1);
    let a = m.acquire(Millis(0), "db", 2 * S, 5 * S).unwrap();
    let r = m.release(Millis(0), "other", 4).unwrap();
    assert!(!sent(&mut m, Millis(0)).is_empty());
    m.handle_timeout(Millis(2_999));
    assert!(!m.wants_close() && m.poll_outcome().is_none());
    m.handle_timeout(Millis(3_000));
    assert!(m.wants_close());
    // Closing the session loses every reply on it.
    assert_eq!(
        m.poll_outcome(),
        Some((a, Outcome::Acquire(AcquireOutcome::Indeterminate)))
    );
    assert_eq!(
        m.poll_outcome(),
        Some((r, Outcome::Release(Release::Indeterminate)))
    );
    // Nothing more goes out on a session being closed.
    let later = m.acquire(Millis(3_000), "db", 2 * S, 5 * S).unwrap();
    assert!(sent(&mut m, Millis(3_000)).is_empty());
    m.connection_lost();
    assert!(m.poll_outcome().is_none(), "the unsent call waits");
    let (wait_s, ..) = acquire_sent(&sent(&mut m, Millis(3_500)));
    assert_eq!(wait_s, 2, "same D on the next connection: 1.5 s left");
    let _ = later;
}

#[test]
fn a_grant_seen_after_d_is_given_back_and_indeterminate() {
    let mut m = Machine::new(1);
    let id = m.acquire(Millis(0), "db", 2 * S, 5 * S).unwrap();
    let (_, _, owner) = acquire_sent(&sent(&mut m, Millis(0)));
    m.receive(
        Millis(2_001),
        &reply(&Reply::Acquired {
            token: 7,
            owner,
            key: "db",
        }),
    );
    assert_eq!(
        m.poll_outcome(),
        Some((id, Outcome::Acquire(AcquireOutcome::Indeterminate)))
    );
    let mut want = Vec::new();
    proto::encode_request(
        &Request::Release {
            token: 7,
            key: "db",
        },
        &mut want,
    );
    assert_eq!(
        sent(&mut m, Millis(2_001)),
        want,
        "the compensating release"
    );
    m.receive(
        Millis(2_002),
        &reply(&Reply::Released {
            token: 7,
            key: "db",
        }),
    );
    assert_eq!(m.poll_outcome(), None, "nobody waits for it");
    assert_eq!(m.pending(), 0);
    // A grant for an owner nobody waits for is given back too.
    m.receive(
        Millis(2_003),
        &reply(&Reply::Acquired {
            token: 8,
            owner: 12_345,
            key: "db",
        }),
    );
    let mut want = Vec::new();
    proto::encode_request(
        &Request::Release {
            token: 8,
            key: "db",
        },
        &mut want,
    );
    assert_eq!(sent(&mut m, Millis(2_003)), want);
}

#[test]
fn t_and_b_are_definitive_and_replies_match_by_owner_in_any_order() {
    let mut m = Machine::new(1);
    let a = m.acquire(Millis(0), "db", Duration::ZERO, 5 * S).unwrap();
    let b = m.acquire(Millis(0), "db", Duration::ZERO, 5 * S).unwrap();
    let bytes = sent(&mut m, Millis(0));
    let (wait_a, _, owner_a) = acquire_sent(&bytes[..14]);
    let (wait_b, _, owner_b) = acquire_sent(&bytes[14..]);
    assert_eq!((wait_a, wait_b), (0, 0), "wait 0 stays one direct attempt");
    assert_ne!(owner_a, owner_b, "a fresh owner per call");
    let mut r = reply(&Reply::Busy {
        owner: owner_b,
        key: "db",
    });
    r.extend(reply(&Reply::Timeout {
        owner: owner_a,
        key: "db",
    }));
    // Split anywhere: bytes arrive as they come.
    m.receive(Millis(1), &r[..5]);
    m.receive(Millis(1), &r[5..]);
    assert_eq!(
        m.poll_outcome(),
        Some((b, Outcome::Acquire(AcquireOutcome::Busy)))
    );
    assert_eq!(
        m.poll_outcome(),
        Some((a, Outcome::Acquire(AcquireOutcome::Timeout)))
    );
}

#[test]
fn wait_zero_and_releases_run_under_the_transport_deadline() {
    let mut m = Machine::new(1);
    let a = m.acquire(Millis(0), "db", Duration::ZERO, 5 * S).unwrap();
    let r = m.release(Millis(0), "db", 3).unwrap();
    m.handle_timeout(Millis(4_999));
    assert_eq!(m.poll_outcome(), None);
    m.handle_timeout(Millis(5_000));
    assert_eq!(
        m.poll_outcome(),
        Some((a, Outcome::Acquire(AcquireOutcome::Timeout)))
    );
    assert_eq!(
        m.poll_outcome(),
        Some((r, Outcome::Release(Release::NotSent)))
    );
}

#[test]
fn a_lost_connection_makes_sent_calls_indeterminate_and_keeps_unsent_ones() {
    let mut m = Machine::new(1);
    let sent_one = m.acquire(Millis(0), "a", 10 * S, 5 * S).unwrap();
    let first = sent(&mut m, Millis(0));
    let (_, _, owner_before) = acquire_sent(&first);
    let unsent = m.acquire(Millis(0), "b", 10 * S, 5 * S).unwrap();
    m.connection_lost();
    assert_eq!(
        m.poll_outcome(),
        Some((sent_one, Outcome::Acquire(AcquireOutcome::Indeterminate)))
    );
    assert_eq!(m.poll_outcome(), None);
    let (wait_s, _, owner) = acquire_sent(&sent(&mut m, Millis(4_000)));
    assert_eq!(wait_s, 6);
    assert_ne!(owner, owner_before);
    // The retried call keeps its owner: the reply to it matches.
    m.receive(Millis(4_000), &reply(&Reply::Timeout { owner, key: "b" }));
    assert_eq!(
        m.poll_outcome(),
        Some((unsent, Outcome::Acquire(AcquireOutcome::Timeout)))
    );
}

#[test]
fn bad_arguments_queue_nothing_and_a_malformed_reply_closes_the_session() {
    let mut m = Machine::new(1);
    assert!(m.acquire(Millis(0), "", S, S).is_err());
    assert!(m.acquire(Millis(0), "a\nb", S, S).is_err());
    assert!(m.acquire(Millis(0), "a", S, Duration::ZERO).is_err());
    assert!(m.acquire(Millis(0), "a", S, 256 * S).is_err());
    assert_eq!(m.pending(), 0);
    let id = m.acquire(Millis(0), "a", S, S).unwrap();
    let _ = sent(&mut m, Millis(0));
    m.receive(Millis(1), b"Z\n");
    assert!(m.wants_close());
    assert_eq!(
        m.poll_outcome(),
        Some((id, Outcome::Acquire(AcquireOutcome::Indeterminate)))
    );
}

fn held(m: &mut Machine, now: Millis, lease: Duration) -> Held {
    m.acquire(now, "db", Duration::ZERO, lease).unwrap();
    let (_, _, owner) = acquire_sent(&sent(m, now));
    m.receive(
        now,
        &reply(&Reply::Acquired {
            token: 5,
            owner,
            key: "db",
        }),
    );
    match m.poll_outcome() {
        Some((_, Outcome::Acquire(AcquireOutcome::Acquired(h)))) => h,
        other => panic!("not acquired: {other:?}"),
    }
}

#[test]
fn an_extend_moves_the_expiry_to_its_write_time_plus_the_lease() {
    let mut m = Machine::new(1);
    let h = held(&mut m, Millis(0), 10 * S);
    assert_eq!(h.expires_at, Millis(10_000));
    let id = m.extend(Millis(3_000), &h, 20 * S).unwrap();
    let mut want = Vec::new();
    proto::encode_request(
        &Request::Extend {
            lease_s: 20,
            token: 5,
            key: "db",
        },
        &mut want,
    );
    assert_eq!(sent(&mut m, Millis(4_000)), want);
    m.receive(
        Millis(4_500),
        &reply(&Reply::Extended {
            token: 5,
            key: "db",
        }),
    );
    let Some((got, Outcome::Extend(ExtendOutcome::Extended(h2)))) = m.poll_outcome() else {
        panic!("not extended");
    };
    assert_eq!(got, id);
    assert_eq!(
        (h2.token, h2.expires_at),
        (5, Millis(24_000)),
        "written + lease"
    );
    // X is definitive.
    m.extend(Millis(5_000), &h2, 20 * S).unwrap();
    let _ = sent(&mut m, Millis(5_000));
    m.receive(
        Millis(5_001),
        &reply(&Reply::NotExtended {
            token: 5,
            key: "db",
        }),
    );
    assert_eq!(
        m.poll_outcome().map(|(_, o)| o),
        Some(Outcome::Extend(ExtendOutcome::Lost))
    );
}

#[test]
fn an_expired_grant_is_not_extended_and_a_late_e_revives_nothing() {
    let mut m = Machine::new(1);
    let h = held(&mut m, Millis(0), 2 * S);
    m.extend(Millis(2_000), &h, 5 * S).unwrap();
    assert_eq!(
        m.poll_outcome().map(|(_, o)| o),
        Some(Outcome::Extend(ExtendOutcome::Lost))
    );
    assert!(sent(&mut m, Millis(2_000)).is_empty(), "nothing sent");
    m.extend(Millis(1_000), &h, 5 * S).unwrap();
    let _ = sent(&mut m, Millis(1_000));
    m.receive(
        Millis(2_000),
        &reply(&Reply::Extended {
            token: 5,
            key: "db",
        }),
    );
    assert_eq!(
        m.poll_outcome().map(|(_, o)| o),
        Some(Outcome::Extend(ExtendOutcome::Lost)),
        "an E at the expiry counts for nothing"
    );
}

#[test]
fn an_unanswered_extend_is_sent_again_on_the_next_connection_until_the_expiry() {
    let mut m = Machine::new(1);
    let h = held(&mut m, Millis(0), 30 * S);
    let id = m.extend(Millis(1_000), &h, 30 * S).unwrap();
    let first = sent(&mut m, Millis(1_000));
    // No reply within the 5 s transport deadline: the session is given
    // up, the extend is not.
    m.handle_timeout(Millis(6_000));
    assert!(m.wants_close());
    assert_eq!(m.poll_outcome(), None);
    m.connection_lost();
    assert_eq!(sent(&mut m, Millis(6_100)), first, "the same extend again");
    m.receive(
        Millis(6_200),
        &reply(&Reply::Extended {
            token: 5,
            key: "db",
        }),
    );
    let Some((got, Outcome::Extend(ExtendOutcome::Extended(h2)))) = m.poll_outcome() else {
        panic!("not extended");
    };
    assert_eq!((got, h2.expires_at), (id, Millis(36_100)));
    // Never past the expiry: a connection that stays down loses it.
    let id = m.extend(Millis(7_000), &h2, 30 * S).unwrap();
    let _ = sent(&mut m, Millis(7_000));
    m.connection_lost();
    m.handle_timeout(Millis(36_099));
    assert_eq!(m.poll_outcome(), None);
    m.handle_timeout(Millis(36_100));
    assert_eq!(
        m.poll_outcome(),
        Some((id, Outcome::Extend(ExtendOutcome::Lost)))
    );
}

#[test]
fn the_same_seed_gives_the_same_owners() {
    let run = |seed| {
        let mut m = Machine::new(seed);
        m.acquire(Millis(0), "a", S, S).unwrap();
        m.acquire(Millis(0), "a", S, S).unwrap();
        sent(&mut m, Millis(0))
    };
    assert_eq!(run(7), run(7));
    assert_ne!(run(7), run(8));
}

#[test]
fn unsent_calls_move_to_another_machine_with_their_owner_and_deadline() {
    let mut first = Machine::new(1);
    first.acquire(Millis(0), "k", 10 * S, 5 * S).unwrap();
    first.release(Millis(0), "k", 3).unwrap();
    let owner = first.queued_owners()[0];
    let moved = first.take_unsent();
    assert_eq!((moved.len(), first.pending()), (2, 0));
    assert_eq!(moved[0].1.key(), "k");
    assert_eq!(moved[0].1.send_deadline(), Millis(10_000), "the same D");
    let mut second = Machine::new(2);
    let ids: Vec<CallId> = moved.into_iter().map(|(_, c)| second.adopt(c)).collect();
    let bytes = sent(&mut second, Millis(4_000));
    let (wait_s, _, sent_owner) = acquire_sent(&bytes[..13]);
    assert_eq!((wait_s, sent_owner), (6, owner), "6 s left of the same D");
    second.receive(Millis(4_001), &reply(&Reply::Timeout { owner, key: "k" }));
    assert_eq!(
        second.poll_outcome(),
        Some((ids[0], Outcome::Acquire(AcquireOutcome::Timeout)))
    );
    assert!(first.poll_outcome().is_none(), "nothing is decided twice");
}

#[test]
fn transmit_at_most_leaves_the_rest_queued_and_unsent() {
    let mut m = Machine::new(1);
    for key in ["a", "b", "c"] {
        m.acquire(Millis(0), key, S, S).unwrap();
    }
    let mut out = Vec::new();
    let n = m.transmit_at_most(Millis(0), &mut out, 1);
    assert_eq!((n, out.len()), (13, 13), "one whole request at least");
    assert_eq!((m.queued(), m.pending()), (2, 3));
    let n = m.transmit_at_most(Millis(0), &mut out, 26);
    assert_eq!((n, m.queued()), (26, 0));
}

#[test]
fn the_deadline_of_a_call_follows_it_from_the_queue_to_the_wire() {
    let mut m = Machine::new(1);
    let id = m.acquire(Millis(0), "k", 2 * S, 5 * S).unwrap();
    assert_eq!(m.deadline_of(id), Some(Millis(2_000)), "D while queued");
    let (_, _, owner) = acquire_sent(&sent(&mut m, Millis(100)));
    assert_eq!(m.deadline_of(id), Some(Millis(3_000)), "D + 1 s once sent");
    m.receive(Millis(200), &reply(&Reply::Busy { owner, key: "k" }));
    assert_eq!(m.deadline_of(id), None, "decided");
    assert_eq!(
        m.poll_outcome(),
        Some((id, Outcome::Acquire(AcquireOutcome::Busy)))
    );
}

#[test]
fn a_reply_to_an_owner_naming_another_key_closes_the_session() {
    let mut m = Machine::new(1);
    let id = m.acquire(Millis(0), "k", 5 * S, 5 * S).unwrap();
    let (_, _, owner) = acquire_sent(&sent(&mut m, Millis(0)));
    m.receive(
        Millis(1),
        &reply(&Reply::Acquired {
            token: 3,
            owner,
            key: "other",
        }),
    );
    assert!(m.wants_close(), "the reply cannot be trusted");
    assert_eq!(
        m.poll_outcome(),
        Some((id, Outcome::Acquire(AcquireOutcome::Indeterminate)))
    );
    assert_eq!(m.take_close_cause(), Some(CloseCause::WrongKey));
    m.connection_lost();
    assert!(sent(&mut m, Millis(2)).is_empty(), "nothing given back");
}

#[test]
fn the_rules_run_on_the_monotonic_clock_too() {
    let start = std::time::Instant::now();
    let mut m: Machine<std::time::Instant> = Machine::on_clock(1, 1024);
    let id = m.acquire(start, "k", 3 * S, 7 * S).unwrap();
    let mut out = Vec::new();
    m.transmit(start + Duration::from_millis(1_500), &mut out);
    let (wait_s, lease_s, owner) = acquire_sent(&out);
    assert_eq!((wait_s, lease_s), (2, 7), "1.5 s left, rounded up");
    m.receive(
        start + 2 * S,
        &reply(&Reply::Acquired {
            token: 4,
            owner,
            key: "k",
        }),
    );
    let Some(d) = m.poll_decided() else {
        panic!("not decided");
    };
    assert_eq!(d.id, id);
    // Reaching its caller after D, the grant is not handed over.
    let Err(late) = d.hand_over(start + 3 * S + Duration::from_millis(1)) else {
        panic!("handed over after D");
    };
    assert_eq!(
        late.expires_at,
        start + Duration::from_millis(1_500) + 7 * S,
        "written + lease"
    );
    m.give_back(start + 4 * S, &late);
    let mut want = Vec::new();
    proto::encode_request(&Request::Release { token: 4, key: "k" }, &mut want);
    let mut out = Vec::new();
    m.transmit(start + 4 * S, &mut out);
    assert_eq!(out, want, "the late grant given back");
}

/// The one Acquire With Limit in `bytes`: (owner, limit, mode).
fn permit_sent(bytes: &[u8]) -> (u64, u16, proto::Mode) {
    match proto::decode_request(bytes, 1024) {
        Decoded::Frame {
            frame: Request::AcquireWithLimit {
                owner, limit, mode, ..
            },
            used,
        } => {
            assert_eq!(used, bytes.len(), "one frame");
            (owner, limit, mode)
        }
        other => panic!("not one acquire with limit: {other:?}"),
    }
}

#[test]
fn an_acquire_with_places_is_sent_as_p_and_its_l_is_final() {
    let mut m = Machine::new(1);
    let id = m
        .acquire_with(Millis(0), "pool", Some(Places::semaphore(8)), 5 * S, 30 * S)
        .unwrap();
    let (owner, limit, mode) = permit_sent(&sent(&mut m, Millis(0)));
    assert_eq!((limit, mode), (8, proto::Mode::Shared));
    let l = Reply::LimitMismatch {
        owner,
        limit: 4,
        key: "pool",
    };
    m.receive(Millis(10), &reply(&l));
    assert_eq!(
        m.poll_outcome(),
        Some((id, Outcome::Acquire(AcquireOutcome::LimitMismatch(4))))
    );
    assert!(!m.wants_close());
    // A grant of a permit is a grant like any other.
    let id = m
        .acquire_with(Millis(20), "rw", Some(Places::exclusive()), 5 * S, 30 * S)
        .unwrap();
    let (owner, limit, mode) = permit_sent(&sent(&mut m, Millis(20)));
    assert_eq!((limit, mode), (u16::MAX, proto::Mode::Exclusive));
    let a = Reply::Acquired {
        token: 77,
        owner,
        key: "rw",
    };
    m.receive(Millis(30), &reply(&a));
    let Some((got, Outcome::Acquire(AcquireOutcome::Acquired(held)))) = m.poll_outcome() else {
        panic!("not acquired");
    };
    assert_eq!((got, held.token), (id, 77));
}

#[test]
fn an_l_for_a_mutex_acquire_closes_the_session_and_a_zero_limit_is_refused() {
    let mut m = Machine::new(1);
    let id = m.acquire(Millis(0), "db", 5 * S, 30 * S).unwrap();
    let (_, _, owner) = acquire_sent(&sent(&mut m, Millis(0)));
    let l = Reply::LimitMismatch {
        owner,
        limit: 3,
        key: "db",
    };
    m.receive(Millis(10), &reply(&l));
    assert!(
        m.wants_close(),
        "a server that answers A with L is not trusted"
    );
    assert_eq!(
        m.poll_outcome(),
        Some((id, Outcome::Acquire(AcquireOutcome::Indeterminate)))
    );
    let zero = Places {
        limit: 0,
        mode: proto::Mode::Shared,
    };
    let mut m = Machine::new(2);
    assert_eq!(
        m.acquire_with(Millis(0), "db", Some(zero), S, S),
        Err(Error::ZeroLimit)
    );
    assert_eq!(m.pending(), 0);
}

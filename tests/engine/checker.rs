//! The history checker itself: each property fails on a history built to
//! break it, with a message naming what broke it, and passes on the correct
//! history next to it.

use ticketd_testkit::checker::{
    ExtendOutcome, History, Outcome, Property, ReleaseOutcome, Violation,
};

const S: u64 = 1_000_000; // one second in microseconds

fn expect_violation(h: &History, property: Property, words: &[&str]) -> Violation {
    let v = h.check().expect_err("the broken history must fail");
    assert_eq!(v.property, property, "wrong property: {v}");
    let text = v.to_string();
    for w in words {
        assert!(text.contains(w), "message {text:?} does not mention {w:?}");
    }
    v
}

/// Client 1 holds "k" (token 1, lease 10 s) from 0; client 2 asks at 1 s.
fn two_clients(release_at: Option<u64>, second_granted_at: u64) -> History {
    let mut h = History::new();
    let a = h.acquire(1, 1, "k", 11, 0, 10, 0);
    h.acquired(a, Outcome::Granted { token: 1 }, 100);
    let b = h.acquire(2, 2, "k", 22, 30, 10, S);
    if let Some(r) = release_at {
        let rel = h.release(1, 1, "k", 1, r);
        h.released(rel, ReleaseOutcome::Released, r + 100);
    }
    h.acquired(b, Outcome::Granted { token: 2 }, second_granted_at);
    h
}

#[test]
fn handover_after_release_passes() {
    let report = two_clients(Some(3 * S), 3 * S + 200).check().unwrap();
    assert_eq!(report.grants, 2);
    assert_eq!(report.releases, 1);
}

#[test]
fn grant_while_the_first_holder_still_holds_fails_mutual_exclusion() {
    // No release: client 1's interval runs to its lease end at 10 s.
    let h = two_clients(None, 5 * S);
    expect_violation(
        &h,
        Property::MutualExclusion,
        &["key \"k\"", "token 1", "client 1", "token 2", "client 2"],
    );
}

#[test]
fn grant_before_the_release_was_even_sent_fails_mutual_exclusion() {
    let h = two_clients(Some(6 * S), 5 * S);
    expect_violation(&h, Property::MutualExclusion, &["[100us, 6000000us)"]);
}

#[test]
fn grant_after_the_conservative_lease_end_passes() {
    // Client 1 never releases; its lease (from its invocation at 0) ends at 10 s.
    assert!(two_clients(None, 10 * S).check().is_ok());
}

#[test]
fn overlap_on_different_keys_is_no_conflict() {
    let mut h = History::new();
    let a = h.acquire(1, 1, "x", 1, 0, 10, 0);
    h.acquired(a, Outcome::Granted { token: 1 }, 10);
    let b = h.acquire(2, 2, "y", 2, 0, 10, 20);
    h.acquired(b, Outcome::Granted { token: 2 }, 30);
    assert!(h.check().is_ok());
}

#[test]
fn late_and_indeterminate_grants_have_no_interval() {
    let mut h = History::new();
    let a = h.acquire(1, 1, "k", 1, 0, 10, 0);
    h.acquired(a, Outcome::Granted { token: 1 }, 10);
    // Another client saw a grant too late to use it: it never entered.
    let b = h.acquire(2, 2, "k", 2, 1, 10, 20);
    h.acquired(b, Outcome::LateGrant { token: 2 }, 2 * S);
    let c = h.acquire(3, 3, "k", 3, 1, 10, 30);
    h.acquired(c, Outcome::Indeterminate, 2 * S);
    h.session_closed(3, 2 * S);
    let r = h.check().unwrap();
    assert_eq!((r.grants, r.late_grants, r.indeterminate), (1, 1, 1));
}

#[test]
fn a_smaller_token_after_a_larger_one_fails_token_order() {
    let mut h = History::new();
    let a = h.acquire(1, 1, "x", 1, 0, 1, 0);
    h.acquired(a, Outcome::Granted { token: 9 }, 10);
    // Invoked after token 9 was received, on another key, yet smaller.
    let b = h.acquire(2, 2, "y", 2, 0, 1, 20);
    h.acquired(b, Outcome::Granted { token: 5 }, 30);
    expect_violation(
        &h,
        Property::TokenOrder,
        &["token 9", "token 5", "invoked later"],
    );
}

#[test]
fn concurrent_grants_may_carry_tokens_in_either_order() {
    let mut h = History::new();
    let a = h.acquire(1, 1, "x", 1, 0, 1, 0);
    let b = h.acquire(2, 2, "y", 2, 0, 1, 5);
    h.acquired(b, Outcome::Granted { token: 3 }, 10);
    h.acquired(a, Outcome::Granted { token: 4 }, 12);
    assert!(h.check().is_ok());
}

#[test]
fn a_token_granted_twice_or_zero_fails_token_order() {
    let mut h = History::new();
    let a = h.acquire(1, 1, "x", 1, 0, 1, 0);
    let b = h.acquire(2, 2, "y", 2, 0, 1, 0);
    h.acquired(a, Outcome::Granted { token: 7 }, 10);
    h.acquired(b, Outcome::LateGrant { token: 7 }, 10);
    expect_violation(&h, Property::TokenOrder, &["token 7 granted twice"]);

    let mut h = History::new();
    let a = h.acquire(1, 1, "x", 1, 0, 1, 0);
    h.acquired(a, Outcome::Granted { token: 0 }, 10);
    expect_violation(&h, Property::TokenOrder, &["token 0"]);
}

#[test]
fn tokens_after_a_restart_must_exceed_those_before() {
    // A server restart that reused tokens shows up as a token-order failure.
    let mut h = History::new();
    let a = h.acquire(1, 1, "k", 1, 0, 1, 0);
    h.acquired(a, Outcome::Granted { token: 100 }, 10);
    h.session_closed(1, 20); // the server was killed
    let b = h.acquire(1, 2, "k", 2, 0, 1, 2 * S);
    h.acquired(b, Outcome::Granted { token: 1 }, 2 * S + 10);
    expect_violation(&h, Property::TokenOrder, &["token 100", "token 1 "]);
}

/// Holder 1 has "k"; waiters 2 then 3 are queued; the holder releases.
fn queue_of_two(second_answer: Outcome, second_at: u64, third_token: u64) -> History {
    let mut h = History::new();
    let a = h.acquire(1, 1, "k", 1, 0, 30, 0);
    h.acquired(a, Outcome::Granted { token: 1 }, 10);
    let w2 = h.acquire(2, 2, "k", 2, 20, 30, 100);
    h.queued(w2, 150);
    let w3 = h.acquire(3, 3, "k", 3, 20, 30, 200);
    h.queued(w3, 250);
    let r = h.release(1, 1, "k", 1, S);
    h.released(r, ReleaseOutcome::Released, S + 50);
    h.acquired(w3, Outcome::Granted { token: third_token }, S + 60);
    h.acquired(w2, second_answer, second_at);
    h
}

#[test]
fn head_waiter_served_first_passes_fifo() {
    // Waiter 2 got token 2 at the release; its reply simply arrived later.
    let h = queue_of_two(Outcome::Granted { token: 2 }, S + 70, 3);
    // Waiter 2 released before waiter 3's grant.
    let mut h = h;
    let r = h.release(2, 2, "k", 2, S + 55);
    h.released(r, ReleaseOutcome::Released, S + 58);
    let report = h.check().unwrap();
    assert_eq!(report.queued, 2);
}

#[test]
fn a_later_waiter_granted_while_the_head_still_waits_fails_fifo() {
    // Waiter 2 (queued first, waiting until 20 s) timed out only at 20 s,
    // but waiter 3 got the key at the release at 1 s.
    let h = queue_of_two(Outcome::Timeout, 20 * S + 150, 2);
    expect_violation(
        &h,
        Property::Fifo,
        &[
            "key \"k\"",
            "client 3",
            "client 2",
            "still waiting",
            "Timeout",
        ],
    );
}

#[test]
fn passing_over_a_waiter_whose_session_closed_passes_fifo() {
    let mut h = queue_of_two(Outcome::Indeterminate, S + 10, 2);
    h.session_closed(2, S - 10);
    assert!(h.check().is_ok());
}

#[test]
fn a_head_waiter_that_never_saw_its_answer_proves_nothing() {
    // Waiter 2's client was stopped: the server granted it, the grant ran
    // out unobserved, and waiter 3 got the key. Nothing is known against it.
    let mut h = queue_of_two(Outcome::Indeterminate, 20 * S, 3);
    h.session_closed(2, 20 * S);
    assert!(h.check().is_ok());
}

#[test]
fn a_later_waiter_granted_ahead_of_a_granted_head_fails_fifo() {
    // The head waiter was served, but after waiter 3 (larger token).
    let mut h = queue_of_two(Outcome::Granted { token: 3 }, 2 * S, 2);
    let r = h.release(3, 3, "k", 2, S + 100);
    h.released(r, ReleaseOutcome::Released, S + 150);
    expect_violation(&h, Property::Fifo, &["Granted { token: 3 }"]);
}

#[test]
fn an_acquire_answered_twice_fails() {
    let mut h = History::new();
    let a = h.acquire(1, 1, "k", 1, 0, 1, 0);
    h.acquired(a, Outcome::Timeout, 10);
    h.acquired(a, Outcome::Busy, 20);
    expect_violation(
        &h,
        Property::AnsweredOnce,
        &["answered twice", "Timeout", "Busy"],
    );
}

#[test]
fn an_unanswered_acquire_needs_a_closed_session() {
    let mut h = History::new();
    let _ = h.acquire(1, 1, "k", 1, 5, 1, 0);
    expect_violation(&h, Property::AnsweredOnce, &["never answered", "client 1"]);
    h.session_closed(1, 6 * S);
    let r = h.check().unwrap();
    assert_eq!(r.indeterminate, 1);
}

#[test]
fn an_answer_after_the_session_closed_fails() {
    let mut h = History::new();
    let a = h.acquire(1, 1, "k", 1, 5, 1, 0);
    h.session_closed(1, 10);
    h.acquired(a, Outcome::Timeout, 20);
    expect_violation(&h, Property::AnsweredOnce, &["after its session closed"]);
}

#[test]
fn releases_must_be_answered_once_too() {
    let mut h = History::new();
    let a = h.acquire(1, 1, "k", 1, 0, 1, 0);
    h.acquired(a, Outcome::Granted { token: 1 }, 10);
    let r = h.release(1, 1, "k", 1, 20);
    expect_violation(&h, Property::AnsweredOnce, &["release", "never answered"]);
    h.released(r, ReleaseOutcome::Released, 30);
    assert!(h.check().is_ok());
    h.released(r, ReleaseOutcome::NotReleased, 40);
    expect_violation(&h, Property::AnsweredOnce, &["answered 2 times"]);
}

#[test]
fn answers_to_unknown_or_future_operations_are_malformed() {
    let mut h = History::new();
    h.acquired(42, Outcome::Timeout, 10);
    expect_violation(&h, Property::Malformed, &["unknown acquire op 42"]);

    let mut h = History::new();
    let a = h.acquire(1, 1, "k", 1, 0, 1, 100);
    h.acquired(a, Outcome::Timeout, 50);
    expect_violation(&h, Property::Malformed, &["before it was invoked"]);
}

/// Client 1 holds "k" with token 5 when the server restarts at 2 s; after
/// the restart client 2 gets "k" while client 1's lease still runs.
fn across_a_restart(first_token: u64, second_token: u64) -> History {
    let mut h = History::new();
    let a = h.acquire(1, 1, "k", 1, 0, 10, 0);
    h.acquired(a, Outcome::Granted { token: 5 }, 100);
    h.session_closed(1, 2 * S);
    h.server_restart(2 * S, first_token);
    let b = h.acquire(2, 2, "k", 2, 0, 10, 3 * S);
    h.acquired(
        b,
        Outcome::Granted {
            token: second_token,
        },
        3 * S + 100,
    );
    h
}

#[test]
fn a_restart_frees_every_key_but_tokens_keep_growing() {
    assert!(across_a_restart(1000, 1000).check().is_ok());
}

#[test]
fn a_restart_that_resumes_below_an_issued_token_fails_token_order() {
    let h = across_a_restart(3, 1000);
    expect_violation(&h, Property::TokenOrder, &["token 5", "first token 3"]);
}

#[test]
fn overlap_within_one_incarnation_still_fails_after_a_restart() {
    let mut h = across_a_restart(1000, 1000);
    let c = h.acquire(3, 3, "k", 3, 0, 10, 4 * S);
    h.acquired(c, Outcome::Granted { token: 1001 }, 4 * S + 100);
    expect_violation(&h, Property::MutualExclusion, &["token 1000", "token 1001"]);
}

/// A restart with a grace claims exclusion across it: the grant inside
/// client 1's lease is then an overlap; one after the lease is not.
#[test]
fn a_restart_with_a_grace_is_checked_for_overlap_across_it() {
    let graced = |granted_us: u64| {
        let mut h = History::new();
        let a = h.acquire(1, 1, "k", 1, 0, 10, 0);
        h.acquired(a, Outcome::Granted { token: 5 }, 100);
        h.session_closed(1, 2 * S);
        h.server_restart_with_grace(2 * S, 1000);
        let b = h.acquire(2, 2, "k", 2, 10, 10, 3 * S);
        h.acquired(b, Outcome::Granted { token: 1000 }, granted_us);
        h
    };
    expect_violation(
        &graced(3 * S + 100),
        Property::MutualExclusion,
        &["token 5", "token 1000"],
    );
    assert!(graced(10 * S).check().is_ok());
}

#[test]
fn a_lease_margin_shortens_every_interval() {
    // Client 2 is granted 500us before client 1's conservative lease end.
    let h = two_clients(None, 10 * S - 500);
    expect_violation(&h, Property::MutualExclusion, &["token 1", "token 2"]);
    assert!(h.check_with_lease_margin(1_000).is_ok());
}

/// Client 1 holds "k" (token 1, lease 10 s, invoked at 0) and extends it by
/// 20 s at 8 s; `answer` is when (and how) the extension was answered.
/// Client 2 is granted "k" at `second_at`.
fn extended(answer: Option<(ExtendOutcome, u64)>, second_at: u64) -> History {
    let mut h = History::new();
    let a = h.acquire(1, 1, "k", 11, 0, 10, 0);
    h.acquired(a, Outcome::Granted { token: 1 }, 100);
    let e = h.extend(1, 1, "k", 1, 20, 8 * S);
    if let Some((outcome, at)) = answer {
        h.extended(e, outcome, at);
    }
    let b = h.acquire(2, 2, "k", 22, 5, 30, second_at - S);
    h.acquired(b, Outcome::Granted { token: 2 }, second_at);
    h
}

/// The operation id `extended` gives its extension.
const EXT_OP: u64 = 1;

/// An E answered before the lease end moves the interval's end to the
/// extension's invocation plus its lease (28 s): a grant to another client
/// at 20 s is an overlap, one at 28 s is not.
#[test]
fn an_extension_answered_in_time_lengthens_the_interval() {
    let h = extended(Some((ExtendOutcome::Extended, 9 * S)), 20 * S);
    expect_violation(
        &h,
        Property::MutualExclusion,
        &["token 1", "[100us, 28000000us)", "token 2"],
    );
    assert!(extended(Some((ExtendOutcome::Extended, 9 * S)), 28 * S)
        .check()
        .is_ok());
}

/// An E answered after the lease end (10 s) revives nothing, and X or no
/// answer moves nothing: the interval ends at 10 s, so a grant at 12 s is
/// fine.
#[test]
fn late_refused_or_unanswered_extensions_do_not_lengthen_the_interval() {
    for answer in [
        Some((ExtendOutcome::Extended, 11 * S)),
        Some((ExtendOutcome::NotExtended, 9 * S)),
        Some((ExtendOutcome::Lost, 10 * S)),
        None,
    ] {
        assert!(
            extended(answer, 12 * S).check().is_ok(),
            "answer {answer:?}"
        );
    }
}

/// A second E may shorten the lease: the interval ends at the latest
/// extension's invocation plus its lease.
#[test]
fn the_latest_extension_in_time_decides_the_end() {
    let mut h = extended(Some((ExtendOutcome::Extended, 9 * S)), 16 * S);
    // At 12 s the holder extends again, by 2 s only: its lease now ends at 14 s.
    let e2 = h.extend(1, 1, "k", 1, 2, 12 * S);
    h.extended(e2, ExtendOutcome::Extended, 12 * S + 100);
    assert!(h.check().is_ok());
}

/// Malformed extension records are refused.
#[test]
fn an_extension_answered_twice_or_unknown_is_refused() {
    let mut h = extended(Some((ExtendOutcome::Extended, 9 * S)), 30 * S);
    h.extended(EXT_OP, ExtendOutcome::Extended, 9 * S + 1);
    assert_eq!(h.check().unwrap_err().property, Property::AnsweredOnce);
    let mut h = extended(None, 30 * S);
    h.extended(999, ExtendOutcome::Extended, 9 * S);
    assert_eq!(h.check().unwrap_err().property, Property::Malformed);
}

/// An extension to a shorter lease may take effect before its answer
/// comes back: from its invocation the interval ends no later than its
/// invocation plus its lease. Client 1 (lease 10 s from 0) extends by 2 s
/// at 3 s and hears nothing back; a grant to client 2 at 6 s is no overlap,
/// one at 4 s is.
#[test]
fn an_unanswered_shorter_extension_shortens_the_interval() {
    let build = |second_at: u64| {
        let mut h = History::new();
        let a = h.acquire(1, 1, "k", 11, 0, 10, 0);
        h.acquired(a, Outcome::Granted { token: 1 }, 100);
        let _ = h.extend(1, 1, "k", 1, 2, 3 * S);
        let b = h.acquire(2, 2, "k", 22, 5, 30, second_at - S);
        h.acquired(b, Outcome::Granted { token: 2 }, second_at);
        h
    };
    assert!(build(6 * S).check().is_ok());
    expect_violation(
        &build(4 * S),
        Property::MutualExclusion,
        &["[100us, 5000000us)"],
    );
}

/// An E cannot lift the bound of another extension that may still apply
/// after it: a 1 s extension invoked at 5 s, in flight when the 20 s one
/// invoked at 5.1 s is answered, keeps the end at 6 s.
#[test]
fn an_e_does_not_outrun_a_shorter_extension_still_in_flight() {
    let build = |second_at: u64| {
        let mut h = History::new();
        let a = h.acquire(1, 1, "k", 11, 0, 10, 0);
        h.acquired(a, Outcome::Granted { token: 1 }, 100);
        let _short = h.extend(1, 1, "k", 1, 1, 5 * S);
        let long = h.extend(1, 1, "k", 1, 20, 5 * S + 100_000);
        h.extended(long, ExtendOutcome::Extended, 5 * S + 200_000);
        let b = h.acquire(2, 2, "k", 22, 5, 30, second_at - S);
        h.acquired(b, Outcome::Granted { token: 2 }, second_at);
        h
    };
    assert!(build(7 * S).check().is_ok());
}

"""PROTOCOL §3 end to end: the Python client against the real ``ticketd``, with
the fault-injecting proxy in between where a rule needs a fault. The proxy's
log shows what the server could have seen; a raw connection straight to the
server shows what the server actually holds."""

from __future__ import annotations

import gc
import signal
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

import pytest
from support import (
    DROP_AND_CLOSE,
    STALL_REPLIES,
    Blackhole,
    CutAfter,
    DelayForward,
    Inject,
    Proxy,
    Ticketd,
    refused_addr,
)

import ticketd

MakeClient = Callable[..., ticketd.Client]
MakeProxy = Callable[..., Proxy]


def owners(reqs: list) -> list[int]:  # type: ignore[type-arg]
    return [r.owner for r in reqs if r.op == "A"]


def test_acquire_and_release_against_the_real_server(
    server: Ticketd, make_client: MakeClient
) -> None:
    c = make_client(server.addr)
    before = time.monotonic()
    res = c.acquire("k", wait=5, lease=30)
    assert res.outcome == "acquired"
    t = res.ticket
    assert t is not None
    assert t.key == "k"
    assert t.token > 0
    assert t.lease == 30
    assert not t.is_expired()
    assert not t.lost.is_set()
    # Counted from the write: after the call started, before it returned + 30.
    assert before + 30 <= t.expires_at <= time.monotonic() + 30
    assert server.holds("k")
    # Held: a wait-0 attempt is a definitive timeout, at once.
    start = time.monotonic()
    assert c.acquire("k", wait=0, lease=1).outcome == "timeout"
    assert time.monotonic() - start < 1
    token = t.token
    assert t.release() == "released"
    assert not server.holds("k")
    assert c.release("k", token) == "not_held"
    # The next grant has a larger token.
    t2 = c.acquire("k", wait=1, lease=1).ticket
    assert t2 is not None and t2.token > token
    assert t2.release() == "released"


def test_timeout_is_definitive_and_comes_at_the_deadline(
    server: Ticketd, make_client: MakeClient
) -> None:
    c = make_client(server.addr)
    holder = c.acquire("k", wait=1, lease=30).ticket
    assert holder is not None
    start = time.monotonic()
    res = c.acquire("k", wait=2, lease=1)
    took = time.monotonic() - start
    assert res.outcome == "timeout" and res.ticket is None
    assert 1.95 <= took < 3, "within D + grace"
    assert server.holds("k")


def test_a_fractional_wait_goes_on_the_wire_rounded_up(
    server: Ticketd, make_proxy: MakeProxy, make_client: MakeClient
) -> None:
    px = make_proxy(server)
    c = make_client(px.addr, pool_size=1)
    holder = c.acquire("k", wait=1, lease=30).ticket
    assert holder is not None
    start = time.monotonic()
    assert c.acquire("k", wait=0.3, lease=1).outcome == "timeout"
    # The server waited its whole (rounded-up) second; D + 1 s had not passed.
    assert time.monotonic() - start < 1.3 + 0.2
    assert [r.wait for r in px.forwarded_for("k", "A")] == [1, 1]


def test_busy_is_definitive_and_immediate(
    start_server: Callable[..., Ticketd], make_client: MakeClient
) -> None:
    server = start_server("--max-waiters-per-key", "1")
    c = make_client(server.addr)
    holder = c.acquire("k", wait=1, lease=30).ticket
    assert holder is not None
    got: list[ticketd.AcquireResult] = []
    waiter = threading.Thread(target=lambda: got.append(c.acquire("k", wait=10, lease=5)))
    waiter.start()
    # The waiter takes the one queue slot: its wait-0 probes see T until then.
    time.sleep(0.3)
    start = time.monotonic()
    assert c.acquire("k", wait=10, lease=1).outcome == "busy"
    assert time.monotonic() - start < 1
    # The queued waiter gets the key, FIFO, when the holder releases.
    assert holder.release() == "released"
    waiter.join()
    t = got[0].ticket
    assert got[0].outcome == "acquired" and t is not None
    assert t.token > holder.token


def test_arguments_are_checked_before_anything_is_sent(
    server: Ticketd, make_proxy: MakeProxy, make_client: MakeClient
) -> None:
    px = make_proxy(server)
    c = make_client(px.addr, max_key_bytes=8)
    for key, wait, lease in [
        ("", 1, 1),
        ("a\nb", 1, 1),
        ("123456789", 1, 1),
        ("k", -1, 1),
        ("k", float("nan"), 1),
        ("k", 1, 0),
        ("k", 1, 256),
        ("k", 1, 1.5),
    ]:
        with pytest.raises(ValueError):
            c.acquire(key, wait=wait, lease=lease)
    with pytest.raises(TypeError):
        c.acquire("k", wait="1", lease=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        c.release("k", -1)
    with pytest.raises(ValueError):
        c.release("", 1)
    # Nothing was sent: not even a connection was opened.
    assert px.accepted == 0
    assert c.acquire("12345678", wait=1, lease=1).outcome == "acquired"


def test_every_call_gets_a_fresh_owner_and_threads_share_a_few_connections(
    server: Ticketd, make_proxy: MakeProxy, make_client: MakeClient
) -> None:
    px = make_proxy(server)
    c = make_client(px.addr, pool_size=2)
    errors: list[str] = []

    def work(i: int) -> None:
        for j in range(20):
            key = f"k{i}-{j}"
            t = c.acquire(key, wait=1, lease=5).ticket
            if t is None:
                errors.append(key)
                continue
            if t.release() != "released":
                errors.append(f"release {key}")

    ts = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert errors == []
    assert px.accepted <= 2, "pipelined over the pool"
    assert px.wait_until(2, lambda p: len(p.forwarded) == 8 * 20 * 2)
    all_owners = owners(px.forwarded)
    assert len(all_owners) == 160
    assert len(set(all_owners)) == 160, "an owner was reused"


def test_a_wait_over_255_seconds_is_clamped_on_the_wire(
    server: Ticketd, make_proxy: MakeProxy, make_client: MakeClient
) -> None:
    px = make_proxy(server)
    c = make_client(px.addr, pool_size=1)
    holder = c.acquire("k", wait=1, lease=30).ticket
    assert holder is not None
    got: list[ticketd.AcquireResult] = []
    waiter = threading.Thread(target=lambda: got.append(c.acquire("k", wait=10_000, lease=5)))
    waiter.start()
    assert px.wait_until(5, lambda p: len(p.forwarded_for("k", "A")) == 2)
    assert px.forwarded_for("k", "A")[1].wait == 255
    assert holder.release() == "released"
    waiter.join()
    assert got[0].outcome == "acquired"


def test_a_connect_delayed_two_seconds_shows_a_wire_wait_two_seconds_shorter(
    server: Ticketd, make_proxy: MakeProxy, make_client: MakeClient
) -> None:
    px = make_proxy(server)
    hole = Blackhole()
    try:
        # The first address swallows the connect for the whole connect timeout.
        c = make_client([hole.addr, px.addr], pool_size=1, connect_timeout=2)
        start = time.monotonic()
        t = c.acquire("slow", wait=5, lease=10).ticket
        assert t is not None
        assert time.monotonic() - start >= 2
        fwd = px.forwarded_for("slow", "A")
        assert [r.wait for r in fwd] == [3], "5 s wait, 2 s spent connecting, rounded up"
        assert "timed out" in (c.last_connect_error or "")
        # Direct, the same call carries the full wait.
        direct = make_client(px.addr, pool_size=1)
        assert direct.acquire("fast", wait=5, lease=10).outcome == "acquired"
        assert [r.wait for r in px.forwarded_for("fast", "A")] == [5]
    finally:
        hole.close()


def test_an_unsent_acquire_moves_to_the_next_address_with_its_deadline(
    server: Ticketd, make_proxy: MakeProxy, make_client: MakeClient
) -> None:
    px = make_proxy(server)
    c = make_client([refused_addr(), px.addr], pool_size=1)
    t = c.acquire("k", wait=5, lease=10).ticket
    assert t is not None
    fwd = px.forwarded_for("k", "A")
    assert len(fwd) == 1 and fwd[0].wait == 5
    assert "refused" in (c.last_connect_error or "").lower()


def test_a_request_still_unsent_at_its_deadline_is_never_sent(make_client: MakeClient) -> None:
    hole = Blackhole()
    try:
        c = make_client(hole.addr, connect_timeout=10)
        start = time.monotonic()
        res = c.acquire("k", wait=1, lease=5)
        took = time.monotonic() - start
        # Never sent, so definitely not acquired: Timeout, at D, not D + 1 s.
        assert res.outcome == "timeout"
        assert 0.95 <= took < 1.5, took
    finally:
        hole.close()


def test_an_acquire_cut_after_it_was_forwarded_is_indeterminate_and_never_sent_again(
    server: Ticketd, make_proxy: MakeProxy, make_client: MakeClient
) -> None:
    px = make_proxy(server)
    key = "cut-after"
    # Exactly one acquire frame gets through, then the connection dies.
    px.set_fault_for(0, CutAfter(12 + len(key)))
    c = make_client(px.addr, pool_size=2)
    start = time.monotonic()
    assert c.acquire(key, wait=5, lease=30).outcome == "indeterminate"
    assert time.monotonic() - start < 2, "known lost when the connection died"
    # The server granted it: indeterminate, not timeout, was the truth.
    assert server.holds(key)
    # Later traffic goes through new connections; the cut acquire is never
    # forwarded again.
    t = c.acquire("other", wait=1, lease=1).ticket
    assert t is not None and t.release() == "released"
    time.sleep(0.3)
    assert len(px.forwarded_for(key)) == 1
    assert len(px.received_for(key)) == 1


def test_an_acquire_cut_inside_its_frame_is_indeterminate_and_nothing_is_held(
    server: Ticketd, make_proxy: MakeProxy, make_client: MakeClient
) -> None:
    px = make_proxy(server)
    px.set_fault_for(0, CutAfter(5))
    c = make_client(px.addr, pool_size=1)
    assert c.acquire("half", wait=5, lease=30).outcome == "indeterminate"
    assert px.forwarded_for("half") == []
    assert len(px.received_for("half")) == 1
    assert not server.holds("half")


def test_an_acquire_dropped_before_forwarding_is_indeterminate_and_not_retried(
    server: Ticketd, make_proxy: MakeProxy, make_client: MakeClient
) -> None:
    px = make_proxy(server)
    px.set_fault_for(0, DROP_AND_CLOSE)
    c = make_client(px.addr, pool_size=1)
    # The client cannot know the proxy dropped it: its bytes went out.
    assert c.acquire("dropped", wait=5, lease=30).outcome == "indeterminate"
    time.sleep(0.3)
    assert len(px.received_for("dropped")) == 1, "never resent"
    assert px.forwarded_for("dropped") == []
    assert not server.holds("dropped")


def test_stalled_replies_past_the_deadline_plus_grace_close_exactly_that_session(
    server: Ticketd, make_proxy: MakeProxy, make_client: MakeClient
) -> None:
    px = make_proxy(server)
    px.set_fault_for(0, STALL_REPLIES)
    c = make_client(px.addr, pool_size=2)
    out: list[tuple[str, float]] = []

    def stalled() -> None:
        start = time.monotonic()
        r = c.acquire("stalled", wait=1, lease=30)
        out.append((r.outcome, time.monotonic() - start))

    th = threading.Thread(target=stalled)
    th.start()
    assert px.wait_until(5, lambda p: len(p.forwarded_for("stalled")) == 1)
    # The second session (connection 1) works meanwhile.
    t = c.acquire("fine", wait=1, lease=5).ticket
    assert t is not None
    th.join()
    outcome, took = out[0]
    assert outcome == "indeterminate"
    assert 1.95 <= took < 2.7, took
    assert px.wait_until(1, lambda p: p.closed_by_client == [0])
    # The other session is still open and serving.
    assert t.release() == "released"
    assert px.closed_by_client == [0]
    # The server did grant it: entering on a guess would have been wrong.
    assert server.holds("stalled")


def test_a_late_grant_is_released_at_once_not_at_the_end_of_its_lease(
    server: Ticketd, make_proxy: MakeProxy, make_client: MakeClient
) -> None:
    px = make_proxy(server)
    # Requests reach the server 1.5 s late, so its queue outlives D.
    px.set_fault_for(0, DelayForward(1.5))
    direct = make_client(server.addr)
    holder = direct.acquire("late", wait=1, lease=30).ticket
    assert holder is not None
    c = make_client(px.addr, pool_size=1)
    start = time.monotonic()
    got: list[ticketd.AcquireResult] = []
    waiter = threading.Thread(target=lambda: got.append(c.acquire("late", wait=2, lease=30)))
    waiter.start()
    # Hand the key over after D (start + 2 s) but before D + 1 s.
    time.sleep(2.3)
    assert holder.release() == "released"
    waiter.join()
    assert got[0].outcome == "indeterminate"
    assert len(owners(px.forwarded_for("late"))) == 1
    # The grant's exact token is released, long before its 30 s lease.
    t = direct.acquire("late", wait=5, lease=1).ticket
    assert t is not None
    assert time.monotonic() - start < 8
    assert px.wait_until(2, lambda p: len(p.forwarded_for("late", "R")) == 1)
    rel = px.forwarded_for("late", "R")
    assert len(rel) == 1, "one compensating release"
    assert holder.token < rel[0].token < t.token
    # The connection was kept: the release went out on it.
    assert px.accepted == 1
    assert px.closed_by_client == []


def test_wait_zero_is_one_attempt_with_a_zero_wire_wait(
    server: Ticketd, make_proxy: MakeProxy, make_client: MakeClient
) -> None:
    px = make_proxy(server)
    c = make_client(px.addr, pool_size=1)
    holder = c.acquire("z", wait=1, lease=30).ticket
    assert holder is not None
    start = time.monotonic()
    assert c.acquire("z", wait=0, lease=1).outcome == "timeout"
    assert time.monotonic() - start < 1
    fwd = px.forwarded_for("z", "A")
    assert [r.wait for r in fwd] == [1, 0]


def test_a_stalled_wait_zero_gives_up_at_the_transport_deadline(
    server: Ticketd, make_proxy: MakeProxy, make_client: MakeClient
) -> None:
    px = make_proxy(server)
    px.set_fault(STALL_REPLIES)
    c = make_client(px.addr, pool_size=1)
    start = time.monotonic()
    res = c.acquire("z", wait=0, lease=1)
    took = time.monotonic() - start
    assert res.outcome == "indeterminate"
    assert 4.95 <= took < 6, took
    assert len(px.forwarded_for("z")) == 1


def test_a_server_that_is_down_costs_the_caller_its_wait_and_no_more(
    server: Ticketd, make_client: MakeClient
) -> None:
    c = make_client(server.addr)
    t = c.acquire("k", wait=1, lease=1).ticket
    assert t is not None
    t.detach()
    server.stop()
    # Once the client has seen the connection close, nothing can be sent.
    end = time.monotonic() + 5
    while c.connected_sessions() > 0:
        assert time.monotonic() < end, "the closed connection went unnoticed"
        time.sleep(0.005)
    start = time.monotonic()
    res = c.acquire("k", wait=1, lease=1)
    took = time.monotonic() - start
    assert res.outcome == "timeout", "never sent"
    assert took < 1.6, took
    assert "refused" in (c.last_connect_error or "").lower()


def test_a_server_over_its_connection_limit_never_hangs_the_caller_or_storms_it(
    start_server: Callable[..., Ticketd], make_proxy: MakeProxy, make_client: MakeClient
) -> None:
    server = start_server("--max-conns", "1")
    occupant = server.raw()
    try:
        px = make_proxy(server)
        c = make_client(px.addr, pool_size=1)
        start = time.monotonic()
        res = c.acquire("k", wait=1, lease=1)
        took = time.monotonic() - start
        # Accepted and closed at once: never sent, or sent into a connection
        # that died; never a grant and never a hang.
        assert res.outcome in ("timeout", "indeterminate")
        assert took < 2.5, took
        assert px.accepted < 40, px.accepted
        assert len(px.forwarded_for("k")) <= 1, "never sent twice"
    finally:
        occupant.sock.close()


def test_a_server_that_dies_under_a_queued_acquire_makes_it_indeterminate_at_once(
    server: Ticketd, make_client: MakeClient
) -> None:
    direct = make_client(server.addr)
    holder = direct.acquire("k", wait=1, lease=30).ticket
    assert holder is not None
    c = make_client(server.addr)
    got: list[tuple[str, float]] = []
    th = threading.Thread(
        target=lambda: got.append((c.acquire("k", wait=20, lease=1).outcome, time.monotonic()))
    )
    th.start()
    time.sleep(0.3)
    server.signal(signal.SIGKILL)
    killed = time.monotonic()
    th.join()
    assert got[0][0] == "indeterminate"
    assert got[0][1] - killed < 1, "not held until D + grace"
    holder.detach()


def test_a_release_without_a_reply_is_indeterminate_after_the_transport_deadline(
    server: Ticketd, make_proxy: MakeProxy, make_client: MakeClient
) -> None:
    px = make_proxy(server)
    px.set_fault_for(1, STALL_REPLIES)
    c = make_client(px.addr, pool_size=2)
    t = c.acquire("r", wait=1, lease=30).ticket
    assert t is not None
    start = time.monotonic()
    # The second connection forwards the release but swallows its reply.
    assert t.release() == "indeterminate"
    took = time.monotonic() - start
    assert 4.95 <= took < 6, took
    assert len(px.forwarded_for("r")) == 2, "sent once, never again"
    # It did take effect: indeterminate was the honest answer.
    assert not server.holds("r")


def test_the_local_expiry_is_conservative_and_a_dropped_ticket_is_released(
    server: Ticketd, make_client: MakeClient
) -> None:
    c = make_client(server.addr)
    t = c.acquire("lease", wait=1, lease=2).ticket
    assert t is not None
    # Just before the local expiry the server still holds the key. Ask the
    # server first, then the ticket: if the server had already let the key
    # go, the ticket must say so too.
    time.sleep(max(0.0, t.remaining() - 0.15))
    assert server.holds("lease") or t.is_expired(), "local expiry later than the server's"
    _, token = t.detach()
    del t
    time.sleep(0.4)
    # Past the server's lease the key can be taken over.
    t2 = c.acquire("lease", wait=2, lease=1).ticket
    assert t2 is not None and t2.token > token
    # Dropping a ticket releases it, without waiting for its lease.
    del t2
    gc.collect()
    t3 = c.acquire("lease", wait=2, lease=30).ticket
    assert t3 is not None, "released on drop"
    del t3
    gc.collect()
    end = time.monotonic() + 1
    while server.holds("lease"):
        assert time.monotonic() < end, "a dropped 30 s ticket is released at once"
        time.sleep(0.01)


def test_a_unix_address_works_and_a_missing_socket_says_why(
    server: Ticketd, make_proxy: MakeProxy, make_client: MakeClient
) -> None:
    with tempfile.TemporaryDirectory() as d:
        path = str(Path(d) / "ticketd.sock")
        px = make_proxy(server, unix_path=path)
        c = make_client(px.addr)
        t = c.acquire("u", wait=1, lease=5).ticket
        assert t is not None
        assert [r.owner for r in px.forwarded_for("u", "A")] != []
        assert t.release() == "released"
        missing = make_client(f"unix:{d}/missing.sock")
        res = missing.acquire("u", wait=0.3, lease=5)
        assert res.outcome == "timeout"
        err = missing.last_connect_error or ""
        assert "missing.sock" in err and "No such file" in err, err


def test_a_closed_client_refuses_new_calls(server: Ticketd) -> None:
    c = ticketd.Client(server.addr)
    t = c.acquire("k", wait=1, lease=5).ticket
    assert t is not None
    c.close()
    assert c.connected_sessions() == 0
    with pytest.raises(RuntimeError, match="closed"):
        c.acquire("k", wait=1, lease=5)
    # Nothing can be sent any more: the lease ends the lock.
    assert t.release() == "indeterminate"
    assert server.holds("k")


def test_a_client_dropped_without_close_ends_its_connections_and_threads(
    server: Ticketd,
) -> None:
    def ours() -> list[str]:
        return [t.name for t in threading.enumerate() if t.name.startswith("ticketd-")]

    before = ours()
    c = ticketd.Client(server.addr, pool_size=2)
    for i in range(4):
        t = c.acquire(f"k{i}", wait=1, lease=5).ticket
        assert t is not None and t.release() == "released"
    assert len(ours()) > len(before)
    del c, t
    gc.collect()
    end = time.monotonic() + 2
    while ours() != before:
        assert time.monotonic() < end, ours()
        time.sleep(0.01)


def test_a_malformed_reply_closes_that_connection_only(
    server: Ticketd, make_proxy: MakeProxy, make_client: MakeClient
) -> None:
    px = make_proxy(server)
    # An unknown op byte, then a reply whose key never ends: both are
    # malformed, the first at once, the second after max_key_bytes + 1.
    px.set_fault_for(0, Inject(b"Z"))
    px.set_fault_for(1, Inject(b"T" + bytes(8) + b"x" * 40))
    c = make_client(px.addr, pool_size=1, max_key_bytes=32)
    for i in range(2):
        res = c.acquire(f"m{i}", wait=1, lease=5)
        # Sent, or withdrawn unsent and retried elsewhere; never a grant
        # made up from garbage.
        assert res.outcome in ("indeterminate", "acquired"), res
        if res.ticket is not None:
            assert res.ticket.release() == "released"
    assert px.wait_until(2, lambda p: p.accepted >= 2)
    t = c.acquire("after", wait=1, lease=5).ticket
    assert t is not None, "later calls go through a new connection"
    assert t.release() == "released"
    assert px.accepted >= 3


def test_a_grant_for_an_owner_nobody_waits_for_is_released_at_once(
    server: Ticketd, make_proxy: MakeProxy, make_client: MakeClient
) -> None:
    # A real grant, detached, and then a copy of its A reply for an owner
    # the client never used: the client gives that exact token back.
    direct = make_client(server.addr)
    t = direct.acquire("orphan", wait=1, lease=30).ticket
    assert t is not None
    _, token = t.detach()
    frame = b"A" + token.to_bytes(8, "big") + (0x5EED).to_bytes(8, "big") + b"orphan\n"
    px = make_proxy(server)
    px.set_fault_for(0, Inject(frame))
    c = make_client(px.addr, pool_size=1)
    assert c.acquire("other", wait=1, lease=5).outcome == "acquired"
    assert px.wait_until(2, lambda p: len(p.forwarded_for("orphan", "R")) == 1)
    assert px.forwarded_for("orphan", "R")[0].token == token
    end = time.monotonic() + 2
    while server.holds("orphan"):
        assert time.monotonic() < end, "the orphan grant was not released"
        time.sleep(0.01)


def test_a_queued_acquire_is_answered_after_later_calls_on_the_same_connection(
    server: Ticketd, make_proxy: MakeProxy, make_client: MakeClient
) -> None:
    """One connection: an acquire waits on a held key while later acquires
    and releases on it are answered first; every reply finds its call."""
    px = make_proxy(server)
    direct = make_client(server.addr)
    holder = direct.acquire("q", wait=1, lease=30).ticket
    assert holder is not None
    c = make_client(px.addr, pool_size=1)
    got: list[ticketd.AcquireResult] = []
    waiter = threading.Thread(target=lambda: got.append(c.acquire("q", wait=10, lease=5)))
    waiter.start()
    assert px.wait_until(5, lambda p: len(p.forwarded_for("q", "A")) == 1)
    for i in range(20):
        t = c.acquire(f"other-{i}", wait=1, lease=5).ticket
        assert t is not None and t.release() == "released"
    assert got == [], "the queued acquire was answered by someone else's reply"
    assert holder.release() == "released"
    waiter.join()
    t = got[0].ticket
    assert got[0].outcome == "acquired" and t is not None
    assert t.token > holder.token and server.holds("q")
    assert t.release() == "released"
    assert px.accepted == 1


def test_an_acquire_whose_connection_dies_while_it_is_queued_is_retried_with_its_owner_and_d(
    server: Ticketd,
    make_proxy: MakeProxy,
    make_client: MakeClient,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first connection dies with the acquire still in its queue (no
    byte of it handed to the socket): the call moves to a new connection
    with the same owner and the same deadline, and is sent exactly once.
    Another caller's request is in flight on the connection meanwhile, so
    the acquire queues for the writer thread instead of being written by
    its caller."""
    from ticketd import _session

    px = make_proxy(server)
    c = make_client(px.addr, pool_size=1)
    holder = make_client(server.addr).acquire("held", wait=1, lease=30).ticket
    assert holder is not None
    waited: list[str] = []
    waiter = threading.Thread(target=lambda: waited.append(c.acquire("held", wait=5).outcome))
    waiter.start()
    assert px.wait_until(5, lambda p: len(p.forwarded_for("held", "A")) == 1)
    real_submit = _session.Session.submit
    queued: list[tuple[int, int]] = []

    def submit_then_die(self: _session.Session, call: _session.Call) -> bool:
        if call.kind != _session.ACQUIRE or queued:
            return real_submit(self, call)
        ok = real_submit(self, call)
        with self._lock:
            # The writer has not run yet (we hold its lock): still queued.
            assert call.phase == _session.QUEUED
            queued.append((call.owner, self.id))
            self._close_locked("connection died under a queued call")
        # The retry comes 1.2 s into the call: its wire wait must show D.
        time.sleep(1.2)
        return ok

    monkeypatch.setattr(_session.Session, "submit", submit_then_die)
    start = time.monotonic()
    res = c.acquire("moved", wait=5, lease=5)
    assert res.outcome == "acquired"
    assert time.monotonic() - start < 2.5
    fwd = px.forwarded_for("moved", "A")
    assert len(queued) == 1 and len(fwd) == 1, (queued, fwd)
    assert fwd[0].owner == queued[0][0], "the retry kept the owner"
    assert fwd[0].conn == 1, "sent on the new connection, never on the dead one"
    assert fwd[0].wait == 4, "5 s wait, 1.2 s gone: the same D, rounded up"
    assert len(px.received_for("moved")) == 1, "no byte of it reached the first connection"
    waiter.join()
    # The request in flight on the connection that died may have been sent.
    assert waited == ["indeterminate"]


def test_a_connection_the_server_closed_while_idle_is_not_written_to(
    server: Ticketd, make_proxy: MakeProxy, make_client: MakeClient
) -> None:
    """The server side of an idle connection goes away; the next acquire,
    written by its own caller, finds the end of the stream before writing
    and goes, definitely unsent, to a new connection: acquired, not
    indeterminate, sent once."""
    px = make_proxy(server)
    c = make_client(px.addr, pool_size=1)
    t = c.acquire("warm", wait=1, lease=5).ticket
    assert t is not None and t.release() == "released"
    px.cut_connections()
    res = c.acquire("after", wait=2, lease=5)
    assert res.outcome == "acquired"
    fwd = px.forwarded_for("after", "A")
    assert [r.conn for r in fwd] == [1]
    assert len(px.received_for("after")) == 1

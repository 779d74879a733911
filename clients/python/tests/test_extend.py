"""PROTOCOL §5.3 end to end: Extend and the keep-alive of ``Client.lock``
against the real ``ticketd`` (protocol 1.1), with the fault proxy where a
rule needs a fault."""

from __future__ import annotations

import signal
import threading
import time
from typing import Callable

import pytest
from support import STALL_REPLIES, Blackhole, CutAfter, Proxy, StallRepliesFor, Ticketd

import ticketd

MakeClient = Callable[..., ticketd.Client]
MakeProxy = Callable[..., Proxy]


def test_extend_moves_the_expiry_counted_from_the_write_and_keeps_the_token(
    server: Ticketd, make_proxy: MakeProxy, make_client: MakeClient
) -> None:
    px = make_proxy(server)
    c = make_client(px.addr, pool_size=1)
    t = c.acquire("e", wait=1, lease=2).ticket
    assert t is not None
    token, first_expiry = t.token, t.expires_at
    time.sleep(1)
    before = time.monotonic()
    assert t.extend(4) == "extended"
    after = time.monotonic()
    assert t.token == token
    assert before + 4 <= t.expires_at <= after + 4
    assert t.expires_at > first_expiry
    ext = px.forwarded_for("e", "E")
    assert [(r.lease, r.token) for r in ext] == [(4, token)]
    # Past the first lease the server still holds the grant, same token.
    time.sleep(max(0.0, first_expiry + 0.5 - time.monotonic()))
    assert server.holds("e")
    # The extension is now the ticket's lease, and the default of the next.
    assert t.lease == 4
    assert t.extend() == "extended"
    assert px.forwarded_for("e", "E")[-1].lease == 4
    assert t.release() == "released"


def test_extend_arguments_are_checked_before_anything_is_sent(
    server: Ticketd, make_proxy: MakeProxy, make_client: MakeClient
) -> None:
    px = make_proxy(server)
    c = make_client(px.addr, pool_size=1)
    t = c.acquire("e", wait=1, lease=5).ticket
    assert t is not None
    for bad in (0, -1, 256, 1.5, float("nan")):
        with pytest.raises(ValueError):
            t.extend(bad)
    with pytest.raises(TypeError):
        t.extend("5")  # type: ignore[arg-type]
    time.sleep(0.1)
    assert px.forwarded_for("e", "E") == []
    assert not t.lost.is_set()


def test_a_ticket_expired_locally_is_lost_for_good_and_nothing_is_sent(
    server: Ticketd, make_proxy: MakeProxy, make_client: MakeClient
) -> None:
    px = make_proxy(server)
    c = make_client(px.addr, pool_size=1)
    t = c.acquire("e", wait=1, lease=1).ticket
    assert t is not None
    time.sleep(max(0.0, t.expires_at - time.monotonic()) + 0.01)
    assert t.is_expired()
    assert t.extend(30) == "lost"
    assert t.lost.is_set()
    assert t.extend(30) == "lost"
    time.sleep(0.1)
    assert px.forwarded_for("e", "E") == []


def test_x_is_definitive_and_the_ticket_stays_lost(
    server: Ticketd, make_proxy: MakeProxy, make_client: MakeClient
) -> None:
    px = make_proxy(server)
    c = make_client(px.addr, pool_size=1)
    t = c.acquire("e", wait=1, lease=30).ticket
    assert t is not None
    # Someone releases the grant by token: an Extend of it is answered X.
    with server.raw() as raw:
        assert raw.release("e", t.token)[0] == "R"
    expiry = t.expires_at
    assert t.extend(30) == "lost"
    assert t.lost.is_set()
    assert t.expires_at == expiry
    assert t.extend(30) == "lost"
    assert len(px.forwarded_for("e", "E")) == 1, "lost for good: not sent again"


def test_an_extend_whose_connection_died_after_sending_is_sent_again(
    server: Ticketd, make_proxy: MakeProxy, make_client: MakeClient
) -> None:
    px = make_proxy(server)
    key = "again"
    # Connection 0 forwards the acquire and the extend, then dies before the
    # extend's reply can come back.
    px.set_fault_for(0, CutAfter((12 + len(key)) + (11 + len(key))))
    c = make_client(px.addr, pool_size=1)
    t = c.acquire(key, wait=1, lease=5).ticket
    assert t is not None
    before = time.monotonic()
    assert t.extend(10) == "extended"
    ext = px.forwarded_for(key, "E")
    assert [(r.conn, r.lease, r.token) for r in ext] == [(0, 10, t.token), (1, 10, t.token)]
    # Counted from the write of the attempt that was answered.
    assert before + 10 <= t.expires_at <= time.monotonic() + 10
    assert t.release() == "released"


def test_an_extend_in_flight_extends_nothing_and_a_stall_is_lost_at_the_expiry(
    server: Ticketd, make_proxy: MakeProxy, make_client: MakeClient
) -> None:
    px = make_proxy(server)
    # Connection 0 carries the acquire; connection 1 swallows every reply.
    px.set_fault_for(1, STALL_REPLIES)
    c = make_client(px.addr, pool_size=2)
    t = c.acquire("stall", wait=1, lease=2).ticket
    assert t is not None
    expiry = t.expires_at
    seen: list[float] = []

    def watch() -> None:
        # While the extend is in flight the old expiry stands.
        while not t.lost.is_set():
            seen.append(t.expires_at)
            time.sleep(0.05)

    w = threading.Thread(target=watch)
    w.start()
    assert t.extend(30) == "lost"
    returned = time.monotonic()
    w.join()
    assert len(px.forwarded_for("stall", "E")) == 1
    assert set(seen) == {expiry}
    assert t.lost.is_set()
    # Given up at the conservative expiry, not later.
    assert expiry <= returned < expiry + 0.3, returned - expiry


def test_the_keep_alive_renews_and_the_exit_releases(
    server: Ticketd, make_proxy: MakeProxy, make_client: MakeClient
) -> None:
    px = make_proxy(server)
    c = make_client(px.addr, pool_size=1)
    with c.lock("ka", wait=1, lease=2) as t:
        token = t.token
        first = t.expires_at
        # Twice the lease: only renewals keep it.
        lost = t.lost.wait(4.5)
        assert not lost
        assert server.holds("ka")
        assert t.expires_at > first + 2
        assert t.token == token
    assert not server.holds("ka")
    ext = px.forwarded_for("ka", "E")
    # Renewed at a third of the lease: about every 0.67 s.
    assert len(ext) >= 5, len(ext)
    assert {(r.lease, r.token) for r in ext} == {(2, token)}
    assert [r.token for r in px.forwarded_for("ka", "R")] == [token]


def test_the_keep_alive_reports_an_x_at_once(server: Ticketd, make_client: MakeClient) -> None:
    c = make_client(server.addr)
    with c.lock("ka", wait=1, lease=30, renew_every=0.2) as t:
        with server.raw() as raw:
            assert raw.release("ka", t.token)[0] == "R"
        released = time.monotonic()
        assert t.lost.wait(2)
        assert time.monotonic() - released < 0.5
        assert t.remaining() > 25, "lost long before the expiry"
    # The exit's release finds nothing to release, and raises nothing.


def test_the_keep_alive_reports_lost_before_the_expiry_when_renewals_stall(
    server: Ticketd, make_proxy: MakeProxy, make_client: MakeClient
) -> None:
    px = make_proxy(server)
    px.set_fault_for(1, STALL_REPLIES)
    c = make_client(px.addr, pool_size=2)
    with c.lock("ka", wait=1, lease=4, renew_every=0.5) as t:
        expiry = t.expires_at
        assert t.lost.wait(8)
        told = time.monotonic()
        # At the renewal deadline, a tenth of the lease before the expiry.
        assert expiry - 0.4 <= told < expiry, told - expiry
        assert t.is_lost()
        assert len(px.forwarded_for("ka", "E")) >= 1


def test_the_keep_alive_reports_lost_before_the_expiry_when_the_server_dies(
    server: Ticketd, make_client: MakeClient
) -> None:
    c = make_client(server.addr)
    with c.lock("ka", wait=1, lease=5) as t:
        server.signal(signal.SIGKILL)
        assert t.lost.wait(8)
        told = time.monotonic()
        assert told < t.expires_at, "told while the lease still runs"
        assert t.expires_at - told <= 0.5 + 0.05


def test_a_lock_lost_with_its_server_ends_the_with_block_at_once(
    server: Ticketd, make_client: MakeClient
) -> None:
    c = make_client(server.addr)
    with c.lock("ka", wait=1, lease=3) as t:
        server.signal(signal.SIGKILL)
        assert t.lost.wait(8)
        lost = time.monotonic()
    # The release went to the background instead of waiting out the 5 s
    # transport deadline for a server that is gone.
    assert time.monotonic() - lost < 1


def test_an_unanswered_extend_is_sent_again_after_the_transport_deadline(
    server: Ticketd, make_proxy: MakeProxy, make_client: MakeClient
) -> None:
    px = make_proxy(server)
    # Connection 1 swallows replies; the connection after it is healthy.
    px.set_fault_for(1, STALL_REPLIES)
    c = make_client(px.addr, pool_size=2)
    t = c.acquire("slow-e", wait=1, lease=30).ticket
    assert t is not None
    start = time.monotonic()
    assert t.extend(30) == "extended"
    took = time.monotonic() - start
    assert 4.95 <= took < 6, took
    ext = px.forwarded_for("slow-e", "E")
    assert [r.conn for r in ext][:1] == [1] and len(ext) == 2, ext
    assert ext[0].token == ext[1].token == t.token
    assert px.wait_until(1, lambda p: 1 in p.closed_by_client)
    assert t.release() == "released"


def test_extend_by_token_from_any_client(server: Ticketd, make_client: MakeClient) -> None:
    holder = make_client(server.addr)
    other = make_client(server.addr)
    t = holder.acquire("tok", wait=1, lease=2).ticket
    assert t is not None
    assert other.extend("tok", t.token, 5) == "extended"
    time.sleep(2.5)
    assert server.holds("tok"), "the extension outlived the first lease"
    assert other.extend("tok", t.token + 1, 5) == "not_held"
    assert other.release("tok", t.token) == "released"
    assert other.extend("tok", t.token, 5) == "not_held"
    with pytest.raises(ValueError):
        other.extend("tok", t.token, 0)


def test_lock_raises_not_acquired_with_the_outcome(
    server: Ticketd, make_client: MakeClient
) -> None:
    c = make_client(server.addr)
    holder = c.acquire("busy", wait=1, lease=30).ticket
    assert holder is not None
    entered = False
    with pytest.raises(ticketd.NotAcquired) as e, c.lock("busy", wait=0.5, lease=5):
        entered = True
    assert not entered
    assert e.value.outcome == "timeout"
    assert e.value.key == "busy"
    assert holder.release() == "released"


def test_lock_releases_when_the_body_raises(server: Ticketd, make_client: MakeClient) -> None:
    c = make_client(server.addr)
    with pytest.raises(KeyError), c.lock("boom", wait=1, lease=30):
        assert server.holds("boom")
        raise KeyError("inside")
    assert not server.holds("boom")


def test_an_extend_past_the_max_hold_is_x_and_the_current_lease_stands(
    start_server: Callable[..., Ticketd], make_client: MakeClient
) -> None:
    server = start_server("--max-hold", "4")
    c = make_client(server.addr)
    t = c.acquire("capped", wait=1, lease=2).ticket
    assert t is not None
    # Within the cap (grant + 4 s >= now + 2 s): extended.
    assert t.extend(2) == "extended"
    expiry = t.expires_at
    # Past it: X, lost for good, and nothing changed on the server.
    assert t.extend(10) == "lost"
    assert t.lost.is_set()
    assert t.expires_at == expiry
    time.sleep(max(0.0, expiry - 0.3 - time.monotonic()))
    assert server.holds("capped"), "the current lease stays as it was"


def test_every_lock_of_a_client_is_renewed_by_one_thread_that_ends_with_the_last(
    server: Ticketd, make_proxy: MakeProxy, make_client: MakeClient
) -> None:
    px = make_proxy(server)
    c = make_client(px.addr, pool_size=1)

    def renewers() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name.startswith("ticketd-renew")]

    def none_left() -> bool:
        deadline = time.monotonic() + 2
        while renewers() and time.monotonic() < deadline:
            time.sleep(0.01)
        return renewers() == []

    # Those of earlier tests' clients end with their locks.
    assert none_left()
    with c.lock("k1", wait=1, lease=3, renew_every=0.3) as t1:
        with c.lock("k2", wait=1, lease=3, renew_every=0.3) as t2:  # noqa: SIM117
            with c.lock("k3", wait=1, lease=3, renew_every=0.3) as t3:
                assert len(renewers()) == 1
                time.sleep(1.5)
                assert not (t1.lost.is_set() or t2.lost.is_set() or t3.lost.is_set())
        assert len(renewers()) == 1
    for key in ("k1", "k2", "k3"):
        assert len(px.forwarded_for(key, "E")) >= 3, key
        assert not server.holds(key)
    assert none_left(), "the renewer ends with the last lock"
    # And comes back for the next one.
    with c.lock("k4", wait=1, lease=3, renew_every=0.3) as t4:
        assert len(renewers()) == 1
        assert not t4.lost.wait(1.0)
    assert len(px.forwarded_for("k4", "E")) >= 2


def test_one_locks_stalled_renewal_never_delays_another_locks(
    server: Ticketd, make_proxy: MakeProxy, make_client: MakeClient
) -> None:
    """Both locks share the renewer thread and one connection; the replies
    for one key are swallowed. That lock is told lost at its renewal
    deadline; the other keeps being renewed on time all along."""
    px = make_proxy(server)
    px.set_fault(StallRepliesFor("slow"))
    c = make_client(px.addr, pool_size=1)
    with c.lock("fast", wait=1, lease=4, renew_every=0.5) as fast:
        with c.lock("slow", wait=1, lease=4, renew_every=0.5) as slow:
            expiry = slow.expires_at
            assert slow.lost.wait(8)
            told = time.monotonic()
            assert expiry - 0.4 <= told < expiry, told - expiry
            assert not fast.lost.is_set()
            # Renewed about every half second while the other stalled
            # (its connection closed once, at the other's give-up).
            assert len(px.forwarded_for("fast", "E")) >= 5
            assert fast.remaining() > 2.5
        assert not fast.lost.wait(1.0)
    assert not server.holds("fast")


def test_a_renewal_that_must_connect_never_delays_another_locks_lost(
    server: Ticketd, make_proxy: MakeProxy, make_client: MakeClient
) -> None:
    """The one connection dies; the next connect goes first to an address
    where it hangs for the connect timeout. A lock whose renewal comes due
    meanwhile is still told lost at its renewal deadline, before its
    expiry, rather than when that connect gives up."""
    px = make_proxy(server)
    hole = Blackhole()
    try:
        c = make_client([px.addr, hole.addr], pool_size=1, connect_timeout=2.5)
        with c.lock("short", wait=1, lease=2, renew_every=1.2) as short:  # noqa: SIM117
            with c.lock("long", wait=1, lease=30, renew_every=0.2):
                px.cut_connections()
                expiry = short.expires_at
                assert short.lost.wait(max(0.0, expiry - time.monotonic())), (
                    "not told lost by the expiry"
                )
                assert time.monotonic() < expiry
    finally:
        hole.close()
